"""bench/gpu_selftest.py's CPU part, for real: the preflight against this machine, the accelerator facts, and on a
machine without NVIDIA hardware the line saying the GPU checks did not run, with exit 0. On a GPU machine the test
runs the same CPU part (`--checks preflight,facts`); the GPU part is `make gpu-check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from shardstack.accel import probe

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_part_of_the_gpu_selftest(tmp_path: Path) -> None:
    has_gpu = probe(torch_facts=False).has_nvidia
    args = ["--checks", "preflight,facts"] if has_gpu else []
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_selftest.py"), *args, "--out",
                           str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows == [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    checks = {r["check"]: r for r in rows}
    assert checks["preflight"]["ok"] is True and "nvidia_pci_functions" in checks["preflight"]["hardware"]
    facts = checks["facts"]
    assert facts["ok"] is True and facts["preflight_agrees"] is True and facts["has_nvidia"] == has_gpu
    if not has_gpu:
        assert facts["accelerator"] == "cpu" and "no NVIDIA hardware" in facts["reason"]
        assert checks["gpu"] == {"check": "gpu", "ok": None, "skipped": "no NVIDIA GPU: GPU checks not run"}
        assert list(checks) == ["preflight", "facts", "gpu"]


def test_gpu_step_runs_its_variants_on_cpu_and_refuses_to_measure_there(tmp_path: Path) -> None:
    """bench/gpu_step.py's code paths (each arch's tiny preset, plain and stage 3, activation checkpointing) on CPU;
    without --smoke-cpu it measures nothing on a machine without CUDA and says so (exit 2)."""
    script = str(REPO / "bench" / "gpu_step.py")
    proc = subprocess.run([sys.executable, script, "--smoke-cpu", "--no-compile", "--models", "llama3-8b:1",
                           "gpt-1.3b", "--stages", "3", "--out", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows == [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    headers = [r for r in rows if r.get("bench") == "gpu_step"]
    assert [(h["model"], h["config"]["n_layer"], h["activation_checkpointing"]) for h in headers] == \
        [("llama3-8b:1", 1, "full"), ("gpt-1.3b", 2, "full")]
    measured = [(r["model"], r["variant"]) for r in rows if "tokens_per_second" in r]
    assert measured == [("llama3-8b:1", "plain"), ("llama3-8b:1", "stage3"), ("gpt-1.3b", "plain"),
                        ("gpt-1.3b", "stage3")]
    assert all(r["ratios"]["plain"] == 1.0 for r in rows if r.get("summary"))
    bad = subprocess.run([sys.executable, script, "--smoke-cpu", "--models", "llama3-9b"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--models 'llama3-9b'" in bad.stderr and "Traceback" not in bad.stderr
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr and refused.stdout == ""
