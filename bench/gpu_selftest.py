"""The GPU path end to end on this machine, in one command and under 10 minutes: one JSON line per check.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install -e '.[train,serve,ops]' && /tmp/v/bin/python bench/gpu_selftest.py
    make gpu-check     # the preflight from the project's venv, the rest from this driver's wheelhouse (Makefile)

checks (seconds on one H200 in parentheses are budgets, not measurements):
  preflight   playbooks/preflight.yml against this machine (local inventory, --check): its hardware facts  (~30 s)
  facts       shardstack.accel's probe: PCI, driver, nvidia-smi, torch; the accelerator class for the driver (~5 s)
  gpu         on a machine without NVIDIA hardware: "no NVIDIA GPU: GPU checks not run", exit 0
  cuda        the fail-loud checks the runtime runs before it starts (driver, torch build, CUDA runtime) (~5 s)
  train_nccl  one torchrun job, --nproc-per-node = #GPUs, ZeRO stage 3, bf16, a small GPT, NCCL (~90 s)
  serve_cuda  `shardstack serve --device cuda` on a random model and one completion (~60 s)
  gpu_step    bench/gpu_step.py: a 1B Llama and 8 layers of Llama 3 8B, plain and stages 0-3, tokens/s, MFU (~4 min)

Exit code: 0 when every check that ran passed, 1 otherwise. `--checks preflight,facts` runs only those.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHECKS = ["preflight", "facts", "cuda", "train_nccl", "serve_cuda", "gpu_step"]
GROUPS = ["train_nodes", "inference_nodes", "storage_server", "monitoring_server", "loadbalancer"]


class SelfTest:
    def __init__(self, wanted: list[str], out: Path | None, work: Path) -> None:
        self.wanted, self.out, self.work = wanted, out, work
        self.failed = False
        self.hardware: dict[str, Any] = {}
        self.facts: Any = None

    def emit(self, row: dict[str, Any]) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(line + "\n")

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if name not in self.wanted:
            return
        t = time.monotonic()
        try:
            row = fn()
        except Exception as exc:  # a check that crashes is a failed check, reported like the others
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        row = {"check": name, **row, "seconds": round(time.monotonic() - t, 1)}
        self.failed |= row.get("ok") is False
        self.emit(row)

    # --- the CPU part ---------------------------------------------------------------------------------------------

    def preflight(self) -> dict[str, Any]:
        from shardstack.ops.runner import run_playbook

        inv = self.work / "hosts.yml"
        inv.write_text(json.dumps({"all": {
            "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
            "children": {g: {"hosts": {"localhost": {}}} for g in GROUPS}}}))

        def on_event(event: dict[str, Any]) -> None:
            facts = (event.get("event_data", {}).get("res") or {}).get("ansible_facts") or {}
            if event.get("event") == "runner_on_ok" and "shardstack_hardware" in facts:
                self.hardware = facts["shardstack_hardware"]

        res = run_playbook("playbooks/preflight.yml", inv, check=True, on_event=on_event,
                           artifacts=self.work / "artifacts")
        host = res.hosts.get("localhost")
        return {"ok": res.success and bool(self.hardware), "hardware": self.hardware,
                "failed_task": host.failed_task if host else None, "message": host.message if host else None}

    def probe(self) -> dict[str, Any]:
        from shardstack.accel import AcceleratorError, accelerator_class, probe

        self.facts = probe(smi=True)
        row: dict[str, Any] = {"ok": True, "has_nvidia": self.facts.has_nvidia, "gpus": self.facts.gpus,
                               "driver": self.facts.driver_version, "torch": self.facts.torch_version,
                               "torch_cuda": self.facts.torch_cuda, "nvidia_smi": self.facts.smi_output}
        try:
            choice = accelerator_class(self.hardware or self.facts.hardware(), self.facts.driver_version)
            row |= {"accelerator": choice.accel.name, "reason": choice.reason}
        except AcceleratorError as exc:
            row |= {"ok": False, "accelerator": None, "reason": str(exc)}
        if self.hardware:  # the preflight and the runtime must see the same hardware
            row["preflight_agrees"] = len(self.hardware.get("nvidia_pci_functions", [])) == self.facts.nvidia_functions
            row["ok"] = row["ok"] and row["preflight_agrees"]
        return row

    # --- the GPU part ---------------------------------------------------------------------------------------------

    def cuda(self) -> dict[str, Any]:
        from shardstack.accel import AcceleratorError, decide_device, gpu_problems

        problems = [str(p) for p in gpu_problems(self.facts)]
        try:
            choice = decide_device(self.facts, "cuda")
            return {"ok": not problems, "device": choice.why, "devices": self.facts.cuda_devices,
                    "problems": problems}
        except AcceleratorError as exc:
            return {"ok": False, "error": str(exc), "problems": problems}

    def train_nccl(self) -> dict[str, Any]:
        data = self.work / "data"
        subprocess.run([sys.executable, "-m", "shardstack", "data", "prepare", "--out", str(data)], check=True,
                       capture_output=True, timeout=300)
        gpus = len(self.facts.cuda_devices)
        job = self.work / "job.yaml"
        job.write_text(json.dumps({
            "model": {"size": "gpt2-124m"}, "data": {"path": str(data)},
            "engine": {"stage": 3, "precision": "bf16", "device": "cuda"},
            "batch": {"global_batch": 8 * gpus, "micro_batch": 4},
            "schedule": {"warmup_steps": 2, "total_steps": 20}, "metrics": {"port": _free_port()}}))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(gpus), "-m", "shardstack", "train", "run", "--config", str(job)],
                              capture_output=True, text=True, timeout=480)
        steps = [row for row in (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")) if "step" in row]
        first = next((x for x in proc.stderr.splitlines() if "shardstack.dist" in x), "")
        last = steps[-1] if steps else {}
        ok = proc.returncode == 0 and len(steps) == 20 and "GPU+NCCL" in first and math.isfinite(last.get("loss", 1e9))
        return {"ok": ok, "ranks": gpus, "first_line": first.split(": ", 1)[-1], "steps": len(steps),
                "loss_first": steps[0]["loss"] if steps else None, "loss_last": last.get("loss"),
                "tokens_per_second": last.get("tokens_per_second"), "step_seconds": last.get("step_seconds"),
                "mfu": last.get("mfu"), "stderr_tail": None if ok else proc.stderr[-1500:]}

    def serve_cuda(self) -> dict[str, Any]:
        from shardstack.serve.demo import write_random_model

        model = write_random_model(self.work / "model", "small")
        port = _free_port()
        log = self.work / "serve.log"
        with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the server
            proc = subprocess.Popen([sys.executable, "-m", "shardstack", "serve", "--model", str(model), "--device",
                                     "cuda", "--port", str(port), "--allow-unsigned"],
                                    stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 240
            while _status(f"{base}/health") != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return {"ok": False, "error": "the server never became ready", "exit": proc.poll()}
                time.sleep(1)
            info = json.loads(urllib.request.urlopen(f"{base}/info", timeout=10).read())
            t = time.monotonic()
            req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "The ", "max_tokens": 32}).encode(),
                                         headers={"Content-Type": "application/json"})
            body = json.loads(urllib.request.urlopen(req, timeout=60).read())
            text = body["choices"][0]["text"]
            return {"ok": str(info.get("device", "")).startswith("cuda") and len(text) > 0,
                    "device": info.get("device"), "completion_seconds": round(time.monotonic() - t, 3),
                    "tokens": body.get("usage", {}).get("completion_tokens")}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.returncode not in (0, -signal.SIGTERM):
                self.emit({"check": "serve_cuda_log", "tail": log.read_text()[-1500:]})

    def gpu_step(self) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_step.py"), "--steps", "5", "--warmup", "2",
                               "--no-compile"], capture_output=True, text=True, timeout=480)
        rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        variants = {f"{r['model']} {r['variant']}": {k: r.get(k) for k in ("tokens_per_second", "mfu",
                                                                          "peak_memory_gib", "error")}
                    for r in rows if "variant" in r}
        ok = proc.returncode == 0 and bool(variants) and not any(v.get("error") for v in variants.values())
        return {"ok": ok, "variants": variants, "summaries": [r for r in rows if r.get("summary")],
                "stderr_tail": None if ok else proc.stderr[-1500:]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except OSError as exc:
        return getattr(exc, "code", 0) or 0


def _preflight_hardware(ap: argparse.ArgumentParser, path: Path) -> dict | None:
    """The hardware fact from the first line a `--checks preflight` run printed (make gpu-check keeps it in a file);
    a preflight that printed nothing or something else is an argument error, not a traceback."""
    try:
        first = path.read_text().splitlines()[0]
        row = json.loads(first)
        assert isinstance(row, dict) and row.get("check") == "preflight"
    except (OSError, IndexError, ValueError, AssertionError) as exc:
        reason = {IndexError: "empty", AssertionError: "its first line is not the preflight's row"}.get(type(exc), exc)
        ap.error(f"--preflight-row {path}: {reason} (run `bench/gpu_selftest.py --checks preflight` into it first)")
    return row.get("hardware")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    ap.add_argument("--preflight-row", type=Path, default=None,
                    help="a file holding the preflight's JSON line from an earlier run (make gpu-check runs the "
                         "preflight from the project's venv, the torch checks from another): facts compares with it")
    args = ap.parse_args()
    wanted = [c.strip() for c in args.checks.split(",") if c.strip()]
    if unknown := set(wanted) - set(CHECKS):
        ap.error(f"unknown check(s) {', '.join(sorted(unknown))}")
    os.environ.setdefault("SHARDSTACK_HOME", str(REPO))
    work = Path(tempfile.mkdtemp(prefix="shardstack-selftest-"))
    st = SelfTest(wanted, args.out, work)
    if args.preflight_row:
        st.hardware = _preflight_hardware(ap, args.preflight_row)
    try:
        st.run("preflight", st.preflight)
        st.run("facts", st.probe)
        gpu_checks = [c for c in wanted if c not in ("preflight", "facts")]
        if st.facts is None and gpu_checks:
            from shardstack.accel import probe

            st.facts = probe(smi=True)
        if gpu_checks and not st.facts.has_nvidia:
            st.emit({"check": "gpu", "ok": None, "skipped": "no NVIDIA GPU: GPU checks not run"})
        elif gpu_checks:
            st.run("cuda", st.cuda)
            for name in ("train_nccl", "serve_cuda", "gpu_step"):
                st.run(name, getattr(st, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if st.failed else 0


if __name__ == "__main__":
    sys.exit(main())
