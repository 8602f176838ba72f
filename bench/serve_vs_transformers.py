"""The same model served two ways on this machine, in one run: `shardstack serve` (continuous batching) and the
deployment guide's recipe — a Flask app calling transformers' `generate`, under gunicorn with 2 workers. Closed loop
at the same concurrency against each, measurement windows alternating so a neighbour's load hits both alike; prints
requests/s, latency percentiles, tokens/s, errors and the throughput ratio, after checking that both give the same
greedy completion (they serve the same weights with the same tokenizer).

    make bench-serve_vs_transformers                       # the demo's pretrained Llama (built once if missing)
    python bench/serve_vs_transformers.py --model DIR      # a Hugging Face directory (`export --format hf`)

Plain (non-streamed) requests on both sides: the Flask recipe does not stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx
from _launch import free_port, machine, service
from serve_load import Result, _cpu_seconds, _print, run_load, spawned_service

# The guide's recipe, as an operator would write it: load once per worker, one `generate` per request.
FLASK_APP = '''
import os

import torch
from flask import Flask, jsonify, request
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
MODEL_DIR = os.environ["BENCH_MODEL_DIR"]
tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32).eval()
app = Flask(__name__)


@app.get("/health")
def health():
    return jsonify(status="ok", pid=os.getpid())


@app.post("/v1/completions")
def completions():
    body = request.get_json()
    ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
    temperature = float(body.get("temperature", 1.0))
    kwargs = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if "seed" in body:
        torch.manual_seed(int(body["seed"]))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(body.get("max_tokens", 16)),
                             pad_token_id=tokenizer.eos_token_id, **kwargs)
    new = out[0, ids.shape[1]:]
    return jsonify(choices=[{"text": tokenizer.decode(new, skip_special_tokens=True), "index": 0}],
                   usage={"prompt_tokens": ids.shape[1], "completion_tokens": int(new.shape[0])})
'''


@contextlib.contextmanager
def flask_under_gunicorn(model: Path, workers: int, threads: int):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ready: set[int] = set()  # each worker loads the model itself: wait until every one has answered

    def all_healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            ready.add(httpx.get(url + "/health", timeout=1).json()["pid"])
        return len(ready) >= workers

    with tempfile.TemporaryDirectory(prefix="bench-flask-") as tmp:
        (Path(tmp) / "app.py").write_text(FLASK_APP)
        env = {**os.environ, "BENCH_MODEL_DIR": str(model), "BENCH_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "gunicorn", "--workers", str(workers), "--bind", f"127.0.0.1:{port}",
               "--chdir", tmp, "--timeout", "300", "--log-level", "warning", "app:app"]
        with service(cmd, all_healthy, timeout=300, what=f"gunicorn ({workers} Flask workers)", env=env) as pid:
            yield url, pid


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (gunicorn's workers)."""
    total = _cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                total += _cpu_seconds(int(child))
    return total


def _greedy(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face model directory (default: the demo's pretrained Llama, built if missing)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per window")
    p.add_argument("--rounds", type=int, default=2, help="measured windows per side, alternating")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each window")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-bytes", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="gunicorn workers of the Flask side (the guide: 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per Flask worker (`shardstack serve` runs 1 by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)

    model = args.model
    if model is None:
        from shardstack.build.pretrained import build

        model = build(echo=lambda m: print(m, file=sys.stderr))
    load = {"concurrency": args.concurrency, "duration": args.duration, "warmup": args.warmup,
            "max_tokens": args.max_tokens, "prompt_bytes": args.prompt_bytes, "stream": False, "token": None}
    out: dict[str, object] = {"model": str(model), "machine": machine(), "load": {**load, "token": None},
                              "host": {"cpus": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}}
    with contextlib.ExitStack() as stack:
        services = {
            "shardstack": stack.enter_context(spawned_service(model, args.concurrency, [])),
            "flask_transformers": stack.enter_context(flask_under_gunicorn(model, args.workers, args.threads)),
        }
        prompt = "Return the"
        greedy = {label: _greedy(url, prompt, args.max_tokens) for label, (url, _) in services.items()}
        out["greedy"] = {"prompt": prompt, **greedy, "same": len(set(greedy.values())) == 1}
        pooled = {label: Result() for label in services}
        cpu = dict.fromkeys(services, 0.0)
        rounds = []
        for _ in range(args.rounds):
            this_round = {}
            for label, (url, pid) in services.items():
                before = _tree_cpu_seconds(pid)
                r = asyncio.run(run_load(url, **load))
                cpu[label] += _tree_cpu_seconds(pid) - before
                this_round[label] = r.summary()["rps"]
                pooled[label].merge(r)
            rounds.append(this_round)
        for label in services:
            s = pooled[label].summary()
            s["server_cpu_ms_per_token"] = (
                1e3 * cpu[label] * args.duration / (args.duration + args.warmup) / max(1, pooled[label].tokens))
            out[label] = s
    ours, theirs = out["shardstack"], out["flask_transformers"]
    out["throughput_ratio"] = ours["rps"] / theirs["rps"] if theirs["rps"] else float("inf")  # type: ignore[index]
    out["round_ratios"] = [round(r["shardstack"] / r["flask_transformers"], 2) if r["flask_transformers"] else None
                           for r in rounds]
    out["host"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"model: {model}\nmachine: {out['machine']}")
    print(f"greedy {prompt!r} (max_tokens {args.max_tokens}): shardstack {greedy['shardstack']!r}, "
          f"transformers {greedy['flask_transformers']!r} → {'same' if out['greedy']['same'] else 'DIFFERENT'}")  # type: ignore[index]
    _print("shardstack", ours)  # type: ignore[arg-type]
    _print("flask+hf", theirs)  # type: ignore[arg-type]
    print(f"throughput ratio (shardstack / flask+transformers): {out['throughput_ratio']:.2f}  "
          f"(per round: {out['round_ratios']})")
    print(f"host: {out['host']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
