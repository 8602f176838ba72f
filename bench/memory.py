"""Measured peak memory per rank beside the estimator's, for each ZeRO stage and activation-checkpointing mode:
building the engine (init), the first optimizer step, and the third (steady state: AdamW's state exists from the
first step on and DDP rebuilds its gradient buckets in the second). One JSON line per run, then a table.

    python bench/memory.py --world-size 2 [--stages 0 1 2 3] [--ac none full] [--impl auto] [--compile]
                           [--malloc tuned] [--n-layer 8 --d-model 768 --n-head 12 --seq-len 512 --micro-batch 2]

Every (stage, AC mode) runs in fresh torchrun processes. On CPU the measured figure is a rank's peak RSS (VmHWM in
/proc/self/status), reset at the start of each phase (/proc/self/clear_refs), minus the baseline: the RSS of the
same process before the model is built — the interpreter, torch, the process group and the first use of the
stage's code paths (a warm-up engine on a 1-layer GPT of width 8, built, stepped and freed first; its cost is
printed as first_use_mib). On GPU: torch.cuda.max_memory_allocated, reset per phase, minus the bytes allocated
before the model. The rank that measured the most is shown, beside the estimate for that rank.

`--malloc tuned` (default) fixes glibc's mmap threshold at 1 MiB (shardstack.train.memory.host.tune_allocator,
as `shardstack export` does), so every freed tensor goes back to the OS and RSS follows the bytes in use, which
is what the estimator predicts (and what max_memory_allocated reports on GPU). `--malloc default` keeps glibc's
dynamic threshold: RSS then also holds freed heap that glibc keeps for reuse.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
from _launch import machine, under_torchrun

MiB = 2**20
PHASES = ("init", "step1", "step3")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class Meter:
    """The peak since `reset`, minus the baseline taken by `zero`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.baseline = 0

    def zero(self) -> None:
        gc.collect()
        self.baseline = torch.cuda.memory_allocated() if self.cuda else _status_bytes("VmRSS")

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the current RSS

    def peak(self) -> int:
        return (torch.cuda.max_memory_allocated() if self.cuda else _status_bytes("VmHWM")) - self.baseline


def worker(args: argparse.Namespace) -> None:
    from shardstack.train.memory.host import tune_allocator

    if args.malloc == "tuned":
        tune_allocator()
    import torch.distributed as dist
    from shardstack.model.spec import ModelConfig
    from shardstack.train.build import build_on_meta
    from shardstack.train.config import EngineConfig, OptimizerConfig
    from shardstack.train.dist import init_distributed, leave_worker, shutdown
    from shardstack.train.engine import build_engine
    from shardstack.train.memory.estimate import estimate_stage

    torch.set_num_threads(1)
    info = init_distributed("auto")
    mcfg = ModelConfig.of(arch="gpt", n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                          seq_len=args.seq_len, vocab_size=256)
    eng_cfg = EngineConfig(stage=args.stage, activation_checkpointing=args.ac, compile=args.compile,
                           activation_checkpointing_every=2 if args.ac == "every_n" else None)
    opt_cfg = OptimizerConfig(impl=args.impl)

    def batch(cfg: ModelConfig, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = cfg.overrides
        assert shape.vocab_size and shape.seq_len
        x = torch.randint(0, shape.vocab_size, (b, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
        x = x.to(info.device)
        return [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]

    meter = Meter(info.device)
    meter.zero()
    meter.reset()
    tiny = ModelConfig.of(arch="gpt", n_layer=1, n_head=1, d_model=8, seq_len=8, vocab_size=256)
    warm_model, warm_materialize = build_on_meta(tiny, 0)
    warm = build_engine(warm_model, eng_cfg, opt_cfg, info, materialize=warm_materialize)
    for _ in range(2):
        warm.forward_backward(batch(tiny, 1))
        warm.step()
    del warm
    first_use = meter.peak()
    data = batch(mcfg, args.micro_batch)
    dist.barrier()
    meter.zero()
    peaks: dict[str, int] = {}
    t0 = time.perf_counter()
    meter.reset()
    model, materialize = build_on_meta(mcfg, 0)  # as the trainer builds it: on the meta device, then the shards
    engine = build_engine(model, eng_cfg, opt_cfg, info, materialize=materialize)
    peaks["init"] = meter.peak()
    for step in (1, 2, 3):
        meter.reset()
        engine.forward_backward(data)
        engine.step()
        peaks[f"step{step}"] = meter.peak()
    est = estimate_stage(engine.module, engine.cfg, args.stage, info.world_size, info.rank, weight_decay=0.1,
                         micro_batch=args.micro_batch, seq_len=args.seq_len, optimizer_impl=args.impl)
    mine = {"baseline": meter.baseline, "first_use": first_use, "peaks": peaks, "estimate": est}
    rows: list = [None] * info.world_size
    dist.all_gather_object(rows, mine)
    if info.is_main:
        out = {"stage": args.stage, "ac": args.ac, "compile": args.compile, "impl": est.optimizer_impl,
               "malloc": args.malloc if info.device.type == "cpu" else "cuda",
               "baseline_mib": [round(r["baseline"] / MiB, 1) for r in rows],
               "first_use_mib": [round(r["first_use"] / MiB, 1) for r in rows]}
        for phase in PHASES:
            worst = max(rows, key=lambda r: r["peaks"][phase])
            e = worst["estimate"]
            estimated = {"init": e.init_peak, "step1": e.first_step_peak, "step3": e.peak}[phase]
            measured = worst["peaks"][phase]
            out[phase] = {"measured_mib": round(measured / MiB, 1), "estimated_mib": round(estimated / MiB, 1),
                          "ratio": round(measured / estimated, 3),
                          "per_rank_mib": [round(r["peaks"][phase] / MiB, 1) for r in rows]}
        out["estimate_mib"] = {k: round(getattr(est, k) / MiB, 1) for k in (
            "total", "working_params", "activations", "optimizer_temporaries")}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out), flush=True)
    del engine, model
    shutdown()
    leave_worker(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--ac", nargs="+", default=["none", "full"], choices=["none", "full", "every_n"],
                    help="activation checkpointing modes to run for each stage (every_n: every 2nd block)")
    ap.add_argument("--impl", default="auto", choices=["auto", "fused", "foreach", "for_loop"], help="optimizer.impl")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (engine.compile)")
    ap.add_argument("--malloc", default="tuned", choices=["tuned", "default"], help="glibc mmap threshold (CPU)")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)  # set by the parent for one torchrun
    args = ap.parse_args()
    if under_torchrun():
        args.ac = args.ac[0]
        worker(args)
        return 0

    params = args.n_layer * 12 * args.d_model**2 + (256 + args.seq_len + 2 * args.n_layer + 1) * args.d_model
    print(f"# memory: GPT {args.n_layer} layers, d {args.d_model}, seq {args.seq_len}, micro-batch {args.micro_batch}: "
          f"{params / 1e6:.1f} M params ({params * 4 / MiB:.0f} MiB fp32); world size {args.world_size}, fp32, AdamW "
          f"impl {args.impl}, compile {args.compile}, malloc {args.malloc}; {machine()}", flush=True)
    print("# measured: per-rank peak RSS (VmHWM) minus the same process's RSS before the model existed (baseline_mib: "
          "interpreter + torch + process group + first use of the code paths, first_use_mib of it), reset per "
          "phase; the rank that measured the most, beside the estimate for that rank (init: init_peak, step1: "
          "first_step_peak, step3: peak)",
          flush=True)
    runs = []
    for stage in args.stages:
        for ac in args.ac:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.world_size), sys.argv[0], *sys.argv[1:], "--stage", str(stage), "--ac", ac]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ})
            if proc.returncode:
                print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
                return proc.returncode
            line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
            print(line, flush=True)
            runs.append(json.loads(line))
    print(f"{'stage':>5} {'AC':>7} {'phase':>6} {'measured MiB':>13} {'estimated MiB':>14} {'ratio':>6}")
    for r in runs:
        for phase in PHASES:
            m = r[phase]
            print(f"{r['stage']:>5} {r['ac']:>7} {phase:>6} {m['measured_mib']:>13.1f} {m['estimated_mib']:>14.1f} "
                  f"{m['ratio']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
