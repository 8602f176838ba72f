"""`shardstack acceptance`'s error paths, the real CLI in a subprocess: no inventory, an unreachable cluster, bad
sizes and thresholds. Each is one line (and a hint) with a non-zero exit, never a traceback, and nothing is started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTACK_INVENTORY"}
    return subprocess.run([sys.executable, "-m", "shardstack", "acceptance", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_no_inventory_is_one_clear_line(tmp_path: Path) -> None:
    proc = _run(cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "shardstack: error: no inventory: pass -i PATH or set SHARDSTACK_INVENTORY\n"
    assert not (tmp_path / "acceptance").exists()


def test_a_missing_inventory_file_is_named(tmp_path: Path) -> None:
    proc = _run("-i", str(tmp_path / "gone.yml"), cwd=tmp_path)
    assert proc.returncode == 2 and "gone.yml does not exist" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unreachable_cluster_stops_before_anything_runs(tmp_path: Path) -> None:
    """Train nodes whose ssh port refuses: one error naming each node and `shardstack check`, exit 1 (a host
    failed), no report written (nothing was measured)."""
    inv = tmp_path / "hosts.yml"
    nodes = {h: {"ansible_host": "127.0.0.1", "ansible_port": 1} for h in ("gone-n1", "gone-n2")}
    inv.write_text(json.dumps({"all": {"hosts": nodes, "vars": {"ansible_connection": "ssh"},
                                       "children": {"train_nodes": {"hosts": {h: {} for h in nodes}}}}}))
    out = tmp_path / "report"
    proc = _run("-i", str(inv), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("shardstack: error:"))
    assert line.startswith("shardstack: error: cannot reach train node(s): gone-n1: "), proc.stderr
    assert "gone-n2: " in line, line
    assert f"hint: shardstack check -i {inv}" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "2"], "steps must be ≥ 3"),
    (["--kill-steps", "50", "--checkpoint-interval", "20"], "kill-steps (50) must be ≥ 3 × the checkpoint interval"),
    (["--min-scaling-efficiency", "1.5"], "threshold min_scaling_efficiency is a fraction"),
    (["--loss-rtol", "0"], "threshold loss_rtol must be a positive number"),
    (["--model-size", "huge"], "--model-size: "),
    (["--keep-runs", "0"], "keep-runs must be ≥ 1"),
])
def test_bad_sizes_and_thresholds_are_refused_before_the_cluster_is_asked(args: list[str], message: str,
                                                                        tmp_path: Path) -> None:
    # An inventory that cannot be reached: a refusal must come before any attempt to reach it.
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {"hosts": {"n1": {"ansible_host": "127.0.0.1", "ansible_port": 1}},
                                       "children": {"train_nodes": {"hosts": {"n1": {}}}}}}))
    proc = _run("-i", str(inv), *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("shardstack: error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "cannot reach" not in proc.stderr
