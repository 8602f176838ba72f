"""Closed-loop load against the inference service: each of C clients sends its next completion as soon as the
previous one ends. Prints RPS, latency and time-to-first-token percentiles, tokens/s and errors by code.

    # against a running service
    bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 16 --duration 20
    # spawn the service twice on a model dir (batching on: --max-concurrency C, off: 1) and compare
    bench/serve_load.py --model DIR --compare --concurrency 16 --duration 10 --rounds 3
    # same, on a seeded random model of a preset size (no export needed)
    bench/serve_load.py --demo small --compare

Streaming requests (the default) give a client-side time-to-first-token; --no-stream measures plain requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _launch import free_port, service


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def merge(self, other: Result) -> None:
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.tokens += other.tokens
        self.codes.update(other.codes)
        self.seconds += other.seconds

    def summary(self) -> dict[str, float | int | dict[str, int]]:
        ok = len(self.latencies)
        return {
            "requests_ok": ok,
            "rps": ok / self.seconds if self.seconds else 0.0,
            "latency_p50_ms": _pct(self.latencies, 50) * 1e3,
            "latency_p99_ms": _pct(self.latencies, 99) * 1e3,
            "ttft_p50_ms": _pct(self.ttfts, 50) * 1e3,
            "ttft_p99_ms": _pct(self.ttfts, 99) * 1e3,
            "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
            "errors": {code: n for code, n in self.codes.items() if code != "200"},
        }


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def _one(client: httpx.AsyncClient, body: dict, stream: bool, res: Result | None) -> None:
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                code = resp.status_code
                if code == 200:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            code = "stream-error"
                        elif chunk["choices"] and first is None:
                            first = time.perf_counter()
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                else:
                    await resp.aread()
        else:
            resp = await client.post("/v1/completions", json=body)
            code = resp.status_code
            if code == 200:
                tokens = resp.json()["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        code = type(exc).__name__
    done = time.perf_counter()
    if res is None:
        return
    res.codes[str(code)] += 1
    if code == 200:
        res.latencies.append(done - started)
        res.ttfts.append((first or done) - started)
        res.tokens += tokens


async def run_load(url: str, *, concurrency: int, duration: float, warmup: float, max_tokens: int,
                   prompt_bytes: int, stream: bool, token: str | None, seed: int = 0) -> Result:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    res = Result()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as client:
        t0 = time.perf_counter()
        measure_from, stop_at = t0 + warmup, t0 + warmup + duration

        async def worker() -> None:
            while (now := time.perf_counter()) < stop_at:
                prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_bytes))
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                        "seed": rng.getrandbits(32), "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                await _one(client, body, stream, res if now >= measure_from else None)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        # Requests started before stop_at may end after it; the window is what the clients were busy.
        res.seconds = max(time.perf_counter(), stop_at) - measure_from
    return res


@contextlib.contextmanager
def spawned_service(model: Path, max_concurrency: int, extra: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", "shardstack", "serve", "--model", str(model), "--port", str(port),
           "--allow-unsigned", "--max-concurrency", str(max_concurrency), *extra]
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    with service(cmd, healthy, timeout=120, what="the service") as pid:
        yield url, pid


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _print(label: str, s: dict) -> None:
    print(f"{label:>13}: {s['rps']:7.1f} req/s  latency p50 {s['latency_p50_ms']:6.1f} ms  "
          f"p99 {s['latency_p99_ms']:6.1f} ms  TTFT p50 {s['ttft_p50_ms']:6.1f} ms  p99 {s['ttft_p99_ms']:6.1f} ms  "
          f"{s['tokens_per_second']:8.1f} tok/s  ok {s['requests_ok']}  errors {s['errors'] or 0}"
          + (f"  server CPU {s['server_cpu_ms_per_token']:.2f} ms/token" if "server_cpu_ms_per_token" in s else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", help="a running service")
    src.add_argument("--model", type=Path, help="exported model dir: spawn the service on it")
    src.add_argument("--demo", metavar="PRESET", default="small",
                     help="spawn on a seeded random model of this preset (default: small)")
    p.add_argument("--compare", action="store_true",
                   help="spawned service only: run with batching on and off and print the ratio")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="spawned services: measured runs per mode, alternating")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each run")
    p.add_argument("--max-tokens", type=int, default=16, help="completion length (short by default)")
    p.add_argument("--prompt-bytes", type=int, default=32)
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `shardstack serve` argument (repeat)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    token = args.token_file.read_text().strip() if args.token_file else None
    load = {"concurrency": args.concurrency, "duration": args.duration, "warmup": args.warmup,
            "max_tokens": args.max_tokens, "prompt_bytes": args.prompt_bytes, "stream": args.stream, "token": token}
    if args.token_file:
        args.serve_arg += ["--token-file", str(args.token_file)]
    out: dict[str, object] = {"load": {k: v for k, v in load.items() if k != "token"}}
    # Closed-loop figures on a shared machine mean little without how busy it was.
    out["host"] = {"cpus": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}

    if args.url:
        out["result"] = asyncio.run(run_load(args.url, **load)).summary()
        if not args.json:
            _print("result", out["result"])  # type: ignore[arg-type]
    else:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            model = args.model
            if model is None:
                from shardstack.serve.demo import write_random_model

                model = write_random_model(Path(tmp) / f"demo-{args.demo}", args.demo)
            out["model"] = str(args.model or f"random {args.demo}")
            modes = {"batching_on": args.concurrency, **({"batching_off": 1} if args.compare else {})}
            # Both services run side by side (an idle one costs next to nothing) and the measurement windows
            # alternate, so a neighbour's load on a shared machine hits both modes alike.
            services = {label: stack.enter_context(spawned_service(model, slots, args.serve_arg))
                        for label, slots in modes.items()}
            pooled = {label: Result() for label in modes}
            cpu = dict.fromkeys(modes, 0.0)
            rounds = []
            for _ in range(args.rounds):
                this_round = {}
                for label, (url, pid) in services.items():
                    cpu_before = _cpu_seconds(pid)
                    r = asyncio.run(run_load(url, **load))
                    cpu[label] += _cpu_seconds(pid) - cpu_before  # includes the unmeasured warm-up window
                    this_round[label] = r.summary()["rps"]
                    pooled[label].merge(r)
                rounds.append(this_round)
            for label in modes:
                out[label] = pooled[label].summary()
                # Work per request, independent of how much CPU the neighbours left us.
                out[label]["server_cpu_ms_per_token"] = (  # type: ignore[index]
                    1e3 * cpu[label] * args.duration / (args.duration + args.warmup) / max(1, pooled[label].tokens))
                if not args.json:
                    _print(label, out[label])  # type: ignore[arg-type]
            if args.compare:
                out["round_ratios"] = [round(r["batching_on"] / r["batching_off"], 2) for r in rounds]
        if args.compare:
            on, off = out["batching_on"], out["batching_off"]
            out["throughput_ratio"] = on["rps"] / off["rps"] if off["rps"] else float("inf")  # type: ignore[index]
            if not args.json:
                print(f"throughput ratio (batching on / off): {out['throughput_ratio']:.2f}"
                      f"  (per round: {out['round_ratios']})")
    out["host"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"host: {out['host']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
