"""Can one client stall a replica? One client sends 1 MiB prompts in a loop while another sends ordinary completions
one after another and a prober asks /health as HAProxy does (every second, 2 s timeout, down after 2 failures).
Prints the other client's latency idle and under the flood side by side, the ratio of their p99s, the flood's
answers, and the prober's slowest answer and longest run of failures. With two or more CPUs the service runs on
CPU 0 and the clients on CPU 1 (clients are other machines in production; here they would otherwise take the
service's CPU), and the flood's body is encoded once.

    python bench/serve_stall.py [--duration 20] [--body-limits derived 8388608]

The model is a random Llama (preset small, context 256) with a byte-level BPE tokenizer of 4096 tokens trained here
on the shipped corpus: the case where encoding a large prompt costs the most. Each --body-limits entry is a service
of its own: `derived` (the service's default, from the context: a 1 MiB body gets 413 on its Content-Length) or a
byte count given as --max-body-bytes (a large one lets the body in: it is refused by its byte length, before the
tokenizer, with 400).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from _launch import free_port, machine, service
from shardstack.model.tokenizer import train_bpe
from shardstack.serve.demo import write_random_model

CORPUS = Path(__file__).resolve().parents[1] / "runtime" / "shardstack" / "corpus" / "stdlib-docstrings.txt"
TOKEN = "bench-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
FLOOD = json.dumps({"prompt": "the quick brown fox jumps over the lazy dog " * (2**20 // 44), "max_tokens": 1}).encode()
PIN = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
CHECK_INTERVAL, CHECK_TIMEOUT, CHECK_FALL = 1.0, 2.0, 2  # loadbalancer role defaults


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def _victim(url: str, stop: threading.Event, out: list[float], codes: Counter) -> None:
    with httpx.Client(base_url=url, headers=HEADERS, timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": "def read_file(path):", "max_tokens": 16})
            codes[r.status_code] += 1
            if r.status_code == 200:
                out.append(time.perf_counter() - t)


def _flooder(url: str, stop: threading.Event, codes: Counter) -> None:
    with httpx.Client(base_url=url, headers=HEADERS, timeout=30) as c:
        while not stop.is_set():
            try:
                r = c.post("/v1/completions", content=FLOOD, headers={"Content-Type": "application/json"})
                codes[r.status_code] += 1
            except httpx.HTTPError as exc:
                codes[type(exc).__name__] += 1


def _prober(url: str, stop: threading.Event, report: dict) -> None:
    run = 0
    with httpx.Client(base_url=url, timeout=CHECK_TIMEOUT) as c:
        while not stop.wait(CHECK_INTERVAL):
            t = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            report["slowest_ms"] = max(report.get("slowest_ms", 0.0), (time.perf_counter() - t) * 1e3)
            run = 0 if ok else run + 1
            report["failures"] = report.get("failures", 0) + (not ok)
            report["longest_failure_run"] = max(report.get("longest_failure_run", 0), run)


def _phase(url: str, seconds: float, flood: bool) -> dict:
    stop, latencies, codes, flood_codes, health = threading.Event(), [], Counter(), Counter(), {}
    threads = [threading.Thread(target=_victim, args=(url, stop, latencies, codes)),
               threading.Thread(target=_prober, args=(url, stop, health))]
    if flood:
        threads.append(threading.Thread(target=_flooder, args=(url, stop, flood_codes)))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return {"n": len(latencies), "p50": _pct(latencies, 50) * 1e3, "p99": _pct(latencies, 99) * 1e3,
            "codes": dict(codes), "flood": dict(flood_codes), "health": health}


def run(model: Path, limit: str, seconds: float, workdir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = workdir / "token"
    token.write_text(TOKEN + "\n")
    cmd = [*(["taskset", "-c", "0"] if PIN else []), sys.executable, "-m", "shardstack", "serve",
           "--model", str(model), "--port", str(port), "--allow-unsigned",
           "--token-file", str(token), "--max-concurrency", "4"]
    if limit != "derived":
        cmd += ["--max-body-bytes", limit]

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    with service(cmd, healthy, timeout=180, what="the service"):
        _phase(url, 3, flood=False)  # warm-up
        idle = _phase(url, seconds, flood=False)
        flooded = _phase(url, seconds, flood=True)
    return {"limit": limit, "idle": idle, "flooded": flooded}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase (idle, then flooded)")
    p.add_argument("--body-limits", nargs="+", default=["derived", "8388608"])
    args = p.parse_args()
    if PIN:
        os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory(prefix="ss-stall-") as tmp:
        tok = Path(tmp) / "tok"
        train_bpe([CORPUS], 4096, str(tok))
        model = write_random_model(Path(tmp) / "llama", "small", arch="llama", tokenizer=tok, fmt="hf", seed=1)
        rows = [run(model, limit, args.duration, Path(tmp)) for limit in args.body_limits]
    print(f"\nserve_stall: {platform.node()}, {machine()}; {args.duration:.0f} s per phase; "
          f"flood body {len(FLOOD) / 2**20:.2f} MiB; " + ("service on CPU 0, clients on CPU 1" if PIN else "unpinned"))
    print(f"{'body limit':>10} | {'idle p50/p99 ms':>16} | {'flooded p50/p99 ms':>18} | {'p99 ratio':>9} | "
          f"{'flood answers':>22} | {'/health slowest ms, failures, longest run':>40}")
    for r in rows:
        i, f = r["idle"], r["flooded"]
        h = f["health"]
        print(f"{r['limit']:>10} | {i['p50']:7.1f} / {i['p99']:6.1f} | {f['p50']:8.1f} / {f['p99']:7.1f} | "
              f"{f['p99'] / i['p99']:9.2f} | {f['flood']!s:>22} | "
              f"{h.get('slowest_ms', 0):.0f}, {h.get('failures', 0)}, {h.get('longest_failure_run', 0)}"
              f"{' (DOWN)' if h.get('longest_failure_run', 0) >= CHECK_FALL else ''}")
        print(f"{'':>10}   the other client: {i['n']} requests idle, {f['n']} flooded; answers {f['codes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
