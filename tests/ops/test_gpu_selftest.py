"""bench/gpu_selftest.py's CPU part, for real: the preflight against this machine, the accelerator facts, and on a
machine without NVIDIA hardware the line saying the GPU checks did not run, with exit 0. On a GPU machine the test
runs the same CPU part (`--checks preflight,facts`); the GPU part is `make gpu-check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
