"""shardstack stage 3 against DeepSpeed ZeRO-3: the same GPT, data (the shipped corpus), batch and optimizer, on CPU
with gloo. Prints tokens/s and per-rank memory of both and the ratios (ours / theirs). DeepSpeed runs twice: with
its ZeRO-3 defaults (tensors under 1e5 elements stay whole on every rank) and with every tensor partitioned.

    make bench-vs_deepspeed ARGS='--world-size 2 [--model small --micro-batch 4 --steps 6]'

DeepSpeed is not a shardstack dependency: it lives in a bench-only venv ($SHARDSTACK_CACHE/bench-ds-venv, default
/var/cache/shardstack/bench-ds-venv) that the make target builds once (torch 2.13.0, then DeepSpeed with
DS_BUILD_OPS=0; DeepSpeed still JIT-compiles its CPU shared-memory comm op with the host's g++ on first use, ~1 min).
Both sides run as separate torchrun jobs; shardstack is imported from this checkout in both (DeepSpeed's side uses
only shardstack.model and shardstack.data, so it trains exactly the same network on exactly the same samples).

Memory is reported two ways: `state_bytes` = parameters + gradients + optimizer state held by the rank, read from
each framework's own partitions, and `rss_growth_bytes` = peak RSS growth of the process from just before the model
is built (includes activations and allocator slack; the same yardstick for both).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS_VENV_PY = "/var/cache/shardstack/bench-ds-venv/bin/python"


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_bytes(ts) -> int:
    import torch

    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from shardstack.model.gpt import GPT, GPTConfig
    from shardstack.model.shapes import GPT_PRESETS as PRESETS
    from shardstack.train.data import Batches, GlobalSampler, TokenDataset
    from shardstack.train.optim import optimizer_param_groups

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mcfg = GPTConfig(**PRESETS[args.model])
    ds = TokenDataset(args.data, mcfg.seq_len)
    global_batch = args.micro_batch * world
    sampler = GlobalSampler(len(ds), global_batch=global_batch, world_size=world, rank=rank, seed=0)
    batches = Batches(ds, sampler, args.micro_batch, torch.device("cpu"))
    losses = []

    if args.mode == "shardstack":
        from shardstack.train.config import EngineConfig, OptimizerConfig
        from shardstack.train.dist import init_distributed
        from shardstack.train.engine import build_engine

        info = init_distributed("cpu")
        rss0 = _rss()
        torch.manual_seed(0)
        engine = build_engine(GPT(mcfg), EngineConfig(stage=3), OptimizerConfig(lr=3e-4, grad_clip=1.0), info)

        def step():
            loss = engine.forward_backward(batches.next_step())
            engine.step(measure=True)
            return loss

        def state_bytes() -> int:
            return engine.last_memory["total"]
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        rss0 = _rss()
        torch.manual_seed(0)
        model = GPT(mcfg)
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            # Default ZeRO-3 keeps tensors under 1e5 elements unpartitioned ("persistent"); --worker
            # deepspeed-full partitions every tensor, as FSDP2 does.
            "zero_optimization": {"stage": 3, **({"stage3_param_persistence_threshold": 0}
                                                 if args.mode == "deepspeed-full" else {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               model_parameters=optimizer_param_groups(model, 0.1))
        measured: dict[str, int] = {}

        def step():
            (x, y), = batches.next_step()
            loss = engine(x, y)
            engine.backward(loss)
            opt = engine.optimizer
            # Before step() frees them: ZeRO-3's fp32 gradient partitions of this rank.
            grads = [t for t in getattr(opt, "fp32_partitioned_groups_flat", []) if t.grad is not None]
            measured["grads"] = _tensor_bytes(t.grad for t in grads) or _tensor_bytes(
                g for gs in getattr(opt, "averaged_gradients", {}).values() for g in gs)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            return float(total) / world

        def state_bytes() -> int:
            opt = engine.optimizer
            params = _tensor_bytes(p.ds_tensor for p in engine.module.parameters())
            # "Persistent" parameters (below stage3_param_persistence_threshold) also stay whole on every rank.
            params += _tensor_bytes(p.data for p in engine.module.parameters() if getattr(p, "ds_persist", False))
            master = _tensor_bytes(getattr(opt, "fp32_partitioned_groups_flat", []))
            states = _tensor_bytes(v for s in opt.optimizer.state.values() for v in s.values())
            return params + master + states + measured.get("grads", 0)

    t0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        losses.append(step())
    dt = time.perf_counter() - t0
    rows = [None] * world
    dist.all_gather_object(rows, (state_bytes(), _rss() - rss0))
    if rank == 0:
        print("RESULT " + json.dumps({
            "framework": args.mode, "world_size": world, "tokens_per_second":
                round(global_batch * mcfg.seq_len * args.steps / dt, 1),
            "state_bytes_per_rank": max(r[0] for r in rows), "rss_growth_bytes_per_rank": max(r[1] for r in rows),
            "losses": [round(x, 5) for x in losses]}), flush=True)
    dist.destroy_process_group()


def launch(mode: str, python: str, args, data: str) -> dict:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world_size),
           __file__, "--worker", mode, "--data", data, "--model", args.model, "--micro-batch", str(args.micro_batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
    raise SystemExit(f"vs_deepspeed: the {mode} run failed (exit {proc.returncode}); last output:\n{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ds-python", default=DS_VENV_PY, help="python of the bench-only DeepSpeed venv")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per framework run")
    ap.add_argument("--worker", choices=["shardstack", "deepspeed", "deepspeed-full"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.mode = args.worker
        worker(args)
        return 0

    if not Path(args.ds_python).exists():
        print(f"vs_deepspeed: no DeepSpeed venv at {args.ds_python}; run `make bench-vs_deepspeed`, which builds it "
              "(DeepSpeed is a bench-only dependency). Nothing was measured.", file=sys.stderr)
        return 2
    check = subprocess.run([args.ds_python, "-c", "import deepspeed, torch; print(deepspeed.__version__, "
                            "torch.__version__)"], capture_output=True, text=True, env={**os.environ,
                                                                                       "DS_ACCELERATOR": "cpu"})
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"vs_deepspeed: DeepSpeed does not import in {args.ds_python}: {last}. Nothing was measured.",
              file=sys.stderr)
        return 2
    ds_version, torch_version = check.stdout.split()[-2:]
    from shardstack.train.data import prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare(None, tmp)
        ours = launch("shardstack", sys.executable, args, tmp)
        theirs = launch("deepspeed", args.ds_python, args, tmp)
        theirs_full = launch("deepspeed-full", args.ds_python, args, tmp)
    summary = {
        "bench": "vs_deepspeed", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
        "world_size": args.world_size, "micro_batch": args.micro_batch,
        "deepspeed_version": ds_version, "torch": torch_version,
    }
    for name, other in (("deepspeed", theirs), ("deepspeed-full", theirs_full)):
        summary[name] = {
            "tokens_per_second_ratio": round(ours["tokens_per_second"] / other["tokens_per_second"], 3),
            "state_bytes_ratio": round(ours["state_bytes_per_rank"] / other["state_bytes_per_rank"], 3),
            "rss_growth_ratio": round(ours["rss_growth_bytes_per_rank"] / max(1, other["rss_growth_bytes_per_rank"]),
                                      3),
        }
    for row in (ours, theirs, theirs_full, summary):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
