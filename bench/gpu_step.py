"""One GPU: a ~1.3B GPT (24 layers, d=2048, seq 2048, bf16) under a plain PyTorch loop and under shardstack
stages 0–3, in one run. Prints tokens/s, MFU against 989 TFLOP/s (H100/H200 dense bf16), peak memory and the
ratio to plain, one JSON line each, then a summary against the targets (stage 3 ≥ 0.97 × plain, MFU ≥ 50%).

    python bench/gpu_step.py [--micro-batch 8 --steps 10 --no-compile --out bench/gpu_step.jsonl]

It refuses to run without a CUDA device. Each variant is built fresh from the same seed; the plain loop is the
reference: fp32 master weights, bf16 autocast, AdamW (foreach), clip_grad_norm_, the same model code.
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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _variants(args):
    yield "plain", None
    for s in args.stages:
        yield f"stage{s}", s


def run_variant(name: str, stage: int | None, args, info, mcfg) -> dict:
    from shardstack.model.gpt import GPT
    from shardstack.train.config import EngineConfig, OptimizerConfig
    from shardstack.train.engine import build_engine

    torch.manual_seed(0)
    with torch.device(info.device):
        model = GPT(mcfg)
    flops_per_token = model.flops_per_token()
    if args.compile:
        # Each block becomes an OptimizedModule before wrapping, so FSDP2's hooks sit outside the compiled graph.
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    optim_cfg = OptimizerConfig(lr=1e-4, grad_clip=1.0)
    if stage is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

        def step(batches):
            for x, y in batches:
                with torch.autocast(info.device.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                (loss / len(batches)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        engine = build_engine(model, EngineConfig(stage=stage, precision="bf16", device=info.device.type), optim_cfg,
                              info)

        def step(batches):
            engine.forward_backward(batches)
            engine.step()

    g = torch.Generator(device=info.device).manual_seed(1)
    batches = [
        (x, x) for x in torch.randint(0, mcfg.vocab_size, (args.accumulation, args.micro_batch, mcfg.seq_len),
                                      device=info.device, generator=g)
    ]
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
    tokens = args.micro_batch * args.accumulation * mcfg.seq_len
    tps = tokens / dt
    return {"variant": name, "stage": stage, "tokens_per_second": round(tps, 1), "step_seconds": round(dt, 4),
            "mfu": round(flops_per_token * tps / (PEAK_TFLOPS * 1e12), 4),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if info.device.type == "cuda"
            else None,
            "params": sum(p.numel() for p in model.parameters()), "compiled": args.compile}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks (default: compiled)")
    ap.add_argument("--out", default=None, help="also append the JSON lines here")
    # Checks the script's code paths on CPU with a tiny model (no figures worth recording).
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke_cpu:
        args.warmup, args.steps, args.micro_batch = 1, 1, 2  # add --no-compile to skip inductor
    elif not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False, "
              f"torch {torch.__version__}); nothing was measured.", file=sys.stderr)
        return 2

    from shardstack.model.gpt import GPTConfig
    from shardstack.train.dist import init_distributed, shutdown

    info = init_distributed("cpu" if args.smoke_cpu else "cuda")
    mcfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32) if args.smoke_cpu else \
        GPTConfig(n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    header = {"bench": "gpu_step", "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
              "model": mcfg.to_dict(), "micro_batch": args.micro_batch, "accumulation": args.accumulation,
              "peak_tflops": PEAK_TFLOPS, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = [header]
    print(json.dumps(header), flush=True)
    for name, stage in _variants(args):
        try:
            row = run_variant(name, stage, args, info, mcfg)
        except torch.OutOfMemoryError as exc:
            row = {"variant": name, "stage": stage, "error": f"CUDA OOM: {str(exc).splitlines()[0]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    plain = next((r for r in rows if r.get("variant") == "plain" and "tokens_per_second" in r), None)
    summary: dict = {"summary": True}
    if plain:
        for r in rows[1:]:
            if "tokens_per_second" in r:
                r["ratio_to_plain"] = round(r["tokens_per_second"] / plain["tokens_per_second"], 3)
        s3 = next((r for r in rows if r.get("stage") == 3 and "ratio_to_plain" in r), None)
        summary |= {"ratios": {r["variant"]: r.get("ratio_to_plain") for r in rows[1:]},
                    "stage3_ratio_target_0.97": None if s3 is None else s3["ratio_to_plain"] >= 0.97,
                    "mfu_target_0.50": {r["variant"]: r["mfu"] >= 0.5 for r in rows[1:] if "mfu" in r}}
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in [*rows, summary]:
                f.write(json.dumps(r) + "\n")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
