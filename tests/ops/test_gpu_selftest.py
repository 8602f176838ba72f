"""bench/gpu_selftest.py's CPU part, for real: the preflight against this machine, the accelerator facts, and on a
machine without NVIDIA hardware the line saying the GPU checks did not run, with exit 0. On a GPU machine the test
runs the same CPU part (`--checks preflight,facts`); the GPU part is `make gpu-check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
    # As make gpu-check runs it: the preflight's row handed to a second run (from the wheelhouse venv) in a file.
    row = tmp_path / "row.json"
    row.write_text(proc.stdout)
    facts_only = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_selftest.py"), "--checks", "facts",
                                 "--preflight-row", str(row)], capture_output=True, text=True, timeout=600,
                                cwd=tmp_path)
    assert facts_only.returncode == 0, facts_only.stderr[-2000:]
    assert json.loads(facts_only.stdout.splitlines()[0])["preflight_agrees"] is True


@pytest.mark.parametrize(("content", "reason"), [
    (None, "No such file"), ("", "empty"), ("not json\n", "Expecting value"),
    ('{"check": "facts"}\n', "its first line is not the preflight's row")])
def test_a_preflight_row_that_is_not_one_is_an_argument_error(tmp_path: Path, content: str | None,
                                                               reason: str) -> None:
    row = tmp_path / "row.json"
    if content is not None:
        row.write_text(content)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_selftest.py"), "--checks", "facts",
                           "--preflight-row", str(row)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--preflight-row {row}: " in proc.stderr and reason in proc.stderr, proc.stderr


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
