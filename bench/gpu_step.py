"""One GPU: a 1B-class Llama (Llama 3.2 1B's shapes) and Llama 3 8B's layer shapes (fewer layers, to fit one GPU),
each under a plain PyTorch loop and under shardstack stages 0–3, in one run, with activation checkpointing, bf16.
Prints tokens/s, MFU against 989 TFLOP/s (H100/H200 dense bf16) and peak memory, one JSON line per variant, then per
model a summary: the ratios to plain and the targets (stage 3 ≥ 0.97 × plain, MFU ≥ 50%).

    python bench/gpu_step.py [--models llama3-1b llama3-8b:8 --seq-len 4096 --micro-batch 4 --steps 10
                              --activation-checkpointing full --no-compile --out bench/gpu_step.jsonl]

A model is NAME[:LAYERS]: a preset of shardstack.model (llama3-1b, llama3-8b, …; gpt-1.3b for the GPT) and
optionally fewer layers than it has. It refuses to run without a CUDA device. Each variant is built fresh from the
same seed. The plain loop is the reference: the same model code and the same per-block activation checkpointing and
compile (shardstack.train.parallelize.prepare_blocks), fp32 master weights, bf16 autocast, AdamW with the kernels
the engine picks (fused on CUDA), clip_grad_norm_.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time

import torch

PEAK_TFLOPS = 989.0
GPT_1P3B = {"arch": "gpt", "n_layer": 24, "n_head": 16, "d_model": 2048}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_config(spec: str, seq_len: int, smoke: bool):
    """NAME[:LAYERS] → shardstack.model.spec.ModelConfig (the tiny preset of the same arch under --smoke-cpu)."""
    from shardstack.model.spec import ModelConfig

    name, _, layers = spec.partition(":")
    fields = dict(GPT_1P3B) if name == "gpt-1.3b" else {"arch": "llama", "size": name}
    if smoke:
        fields = {"arch": fields["arch"], "size": "tiny"}
    if layers:
        fields["n_layer"] = int(layers)
    return ModelConfig.of(**fields, seq_len=seq_len)


def _variants(args):
    yield "plain", None
    for s in args.stages:
        yield f"stage{s}", s


def run_variant(name: str, stage: int | None, args, info, mcfg) -> dict:
    from shardstack.model.spec import build_model
    from shardstack.train.config import EngineConfig, OptimizerConfig
    from shardstack.train.engine import build_engine
    from shardstack.train.parallelize import prepare_blocks

    torch.manual_seed(0)
    with torch.device(info.device):
        model = build_model(mcfg)
    flops_per_token = model.flops_per_token()
    params = sum(p.numel() for p in model.parameters())
    engine_cfg = EngineConfig(stage=3 if stage is None else stage, precision="bf16", device=info.device.type,
                              activation_checkpointing=args.activation_checkpointing, compile=args.compile)
    optim_cfg = OptimizerConfig(lr=1e-4, grad_clip=1.0)
    if stage is None:
        prepare_blocks(model.blocks, engine_cfg, info.device)
        fused = info.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused,
                                foreach=not fused)

        def step(batches):
            for x, y in batches:
                with torch.autocast(info.device.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                (loss / len(batches)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        engine = build_engine(model, engine_cfg, optim_cfg, info)

        def step(batches):
            engine.forward_backward(batches)
            engine.step()

    seq_len, vocab = model.config.seq_len, model.config.vocab_size
    g = torch.Generator(device=info.device).manual_seed(1)
    batches = [(x, x) for x in torch.randint(0, vocab, (args.accumulation, args.micro_batch, seq_len),
                                             device=info.device, generator=g)]
    for _ in range(args.warmup):
        step(batches)
    sync()
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(batches)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    tps = args.micro_batch * args.accumulation * seq_len / dt
    return {"variant": name, "stage": stage, "tokens_per_second": round(tps, 1), "step_seconds": round(dt, 4),
            "mfu": round(flops_per_token * tps / (PEAK_TFLOPS * 1e12), 4),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if info.device.type == "cuda"
            else None, "params": params}


def bench_model(spec: str, args, info) -> list[dict]:
    from shardstack.model.spec import arch_config

    mcfg = model_config(spec, args.seq_len, args.smoke_cpu)
    header = {"bench": "gpu_step", "model": spec, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
              "config": {k: v for k, v in arch_config(mcfg).to_dict().items() if not isinstance(v, dict)},
              "micro_batch": args.micro_batch, "accumulation": args.accumulation,
              "activation_checkpointing": args.activation_checkpointing, "compiled": args.compile,
              "peak_tflops": PEAK_TFLOPS, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = [header]
    print(json.dumps(header), flush=True)
    for name, stage in _variants(args):
        try:
            row = {"model": spec, **run_variant(name, stage, args, info, mcfg)}
        except torch.OutOfMemoryError as exc:
            row = {"model": spec, "variant": name, "stage": stage, "error": f"CUDA OOM: {str(exc).splitlines()[0]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    plain = next((r for r in rows if r.get("variant") == "plain" and "tokens_per_second" in r), None)
    summary: dict = {"summary": True, "model": spec}
    if plain:
        ratios = {r["variant"]: round(r["tokens_per_second"] / plain["tokens_per_second"], 3) if "tokens_per_second"
                  in r else None for r in rows[1:]}
        s3 = ratios.get("stage3")
        summary |= {"ratios": ratios, "stage3_ratio_target_0.97": None if s3 is None else s3 >= 0.97,
                    "mfu_target_0.50": {r["variant"]: r["mfu"] >= 0.5 for r in rows[1:] if "mfu" in r}}
    print(json.dumps(summary), flush=True)
    return [*rows, summary]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama3-1b", "llama3-8b:8"], metavar="NAME[:LAYERS]")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    ap.add_argument("--activation-checkpointing", choices=["none", "full"], default="full")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks (default: compiled)")
    ap.add_argument("--out", default=None, help="also append the JSON lines here")
    # Checks the script's code paths on CPU with each arch's tiny preset (no figures worth recording).
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from shardstack.errors import ShardstackError
    from shardstack.model.spec import arch_config

    for spec in args.models:  # every name checked before anything is measured
        try:
            arch_config(model_config(spec, args.seq_len, smoke=False))
        except (ShardstackError, ValueError, TypeError) as exc:
            print(f"bench/gpu_step.py: --models {spec!r}: {exc}", file=sys.stderr)
            return 2
    if args.smoke_cpu:
        args.warmup, args.steps, args.micro_batch, args.seq_len = 1, 1, 2, 32  # add --no-compile to skip inductor
    elif not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False, "
              f"torch {torch.__version__}); nothing was measured.", file=sys.stderr)
        return 2

    from shardstack.train.dist import init_distributed, shutdown

    info = init_distributed("cpu" if args.smoke_cpu else "cuda")
    rows = [row for spec in args.models for row in bench_model(spec, args, info)]
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
