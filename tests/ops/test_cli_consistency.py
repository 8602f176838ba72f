"""The CLI's consistency (issue 28): which inventory a command targets, `-e @file`, exit codes, `--json` on every
command that reports, names that mean one thing, cordon state outside the inventory, one set of serving defaults.
The real CLI in a subprocess (or `main([...])`), on local hosts or a loopback server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTACK_INVENTORY"}
    return {**env, **extra}


def shardstack(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, timeout=180,
                          cwd=cwd, env=env or _env())


def _local_inventory(path: Path, **groups: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hosts = sorted({h for members in groups.values() for h in members})
    path.write_text(json.dumps({"all": {
        "hosts": {h: {} for h in hosts},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "children": {g: {"hosts": {h: {} for h in members}} for g, members in groups.items()},
    }}))
    return path


# 1. Inventory selection ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["status"], ["deploy"], ["node", "cordon", "n1"], ["train", "logs", "job"],
                                  ["logs"], ["serve", "rollout"], ["artifacts", "prune"]])
def test_no_inventory_anywhere_is_one_clear_line(argv: list[str], tmp_path: Path) -> None:
    """No -i, no $SHARDSTACK_INVENTORY, no lab inventory here: exit 2 and one line, never the lab by accident."""
    proc = shardstack(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "shardstack: error: no inventory: pass -i PATH or set SHARDSTACK_INVENTORY\n"


def test_shardstack_inventory_wins_over_the_lab(tmp_path: Path) -> None:
    """A configured real inventory is used even where a lab inventory exists; -i wins over both."""
    _local_inventory(tmp_path / "inventory" / "lab" / "hosts.yml", train_nodes=["labnode"])
    real = _local_inventory(tmp_path / "prod" / "hosts.yml", train_nodes=["prodnode"])
    other = _local_inventory(tmp_path / "other" / "hosts.yml", train_nodes=["othernode"])
    # An unknown node's error lists the inventory's train nodes: which inventory was read.
    lab = shardstack("node", "cordon", "nope", cwd=tmp_path)
    assert lab.returncode == 2 and "nodes: labnode" in lab.stderr, lab.stderr
    env = shardstack("node", "cordon", "nope", cwd=tmp_path, env=_env(SHARDSTACK_INVENTORY=str(real)))
    assert env.returncode == 2 and "nodes: prodnode" in env.stderr, env.stderr
    flag = shardstack("node", "cordon", "nope", "-i", str(other), cwd=tmp_path,
                      env=_env(SHARDSTACK_INVENTORY=str(real)))
    assert flag.returncode == 2 and "nodes: othernode" in flag.stderr, flag.stderr
    missing = shardstack("status", cwd=tmp_path, env=_env(SHARDSTACK_INVENTORY=str(tmp_path / "gone.yml")))
    assert missing.returncode == 2 and "gone.yml does not exist" in missing.stderr
    assert "Traceback" not in lab.stderr + env.stderr + flag.stderr + missing.stderr


def test_help_says_where_the_default_inventory_comes_from() -> None:
    out = " ".join(shardstack("status", "--help").stdout.split())
    assert "$SHARDSTACK_INVENTORY when set, else inventory/lab/hosts.yml when it exists" in out


# 2. -e @FILE (what arrives, literally: tests/ops/test_template_injection.py) ---------------------------------------

@pytest.mark.parametrize("content, needle", [
    (None, "cannot read extra-vars file"),
    ("[1, 2]\n", "must hold a mapping"),
    ("a: [unclosed\n", "is not YAML or JSON"),
    ('{"not a name": 1}', "is not an identifier"),
    ("when: 2024-01-31\n", "quote dates"),
])
def test_bad_extra_vars_files_are_usage_errors(content: str | None, needle: str, tmp_path: Path) -> None:
    file = tmp_path / "vars.yml"
    if content is not None:
        file.write_text(content)
    inv = _local_inventory(tmp_path / "hosts.yml", train_nodes=["h1"])
    proc = shardstack("deploy", "-i", str(inv), "-e", f"@{file}")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
