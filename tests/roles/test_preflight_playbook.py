"""The preflight play itself, run by ansible-playbook on a local inventory (no lab): groups and variable checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GROUPS = ["train_nodes", "inference_nodes", "storage_server", "monitoring_server", "loadbalancer"]


def _run(tmp_path: Path, groups: list[str], host_vars: dict, playbook_file: str = "preflight.yml",
         *extra: str) -> subprocess.CompletedProcess:
    inventory = {
        "all": {
            "hosts": {
                "node1": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **host_vars}
            },
            "children": {g: {"hosts": {"node1": {}}} for g in groups},
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
    }
    playbook = Path(sys.executable).parent / "ansible-playbook"
    return subprocess.run(
        [str(playbook), "-i", str(tmp_path / "hosts.yml"), str(REPO / "playbooks" / playbook_file), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_valid_inventory_passes(tmp_path: Path) -> None:
    proc = _run(tmp_path, GROUPS, {"nvidia_driver_branch": "550", "shared_storage_backend": "bind"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed=0" in proc.stdout


def test_misspelled_role_variable_fails_with_a_suggestion(tmp_path: Path) -> None:
    proc = _run(tmp_path, GROUPS, {"nvidia_driver_brnach": "550", "nccl_debug": "INFO"})
    assert proc.returncode != 0
    assert "unknown variable(s) nvidia_driver_brnach (did you mean nvidia_driver_branch?)" in proc.stdout


@pytest.mark.parametrize("missing", ["storage_server", "loadbalancer"])
def test_missing_group_fails(tmp_path: Path, missing: str) -> None:
    proc = _run(tmp_path, [g for g in GROUPS if g != missing], {})
    assert proc.returncode != 0
    assert f"inventory lacks group(s) {missing}" in proc.stdout


def test_slurm_scheduler_needs_the_controller_group(tmp_path: Path) -> None:
    proc = _run(tmp_path, GROUPS, {"shardstack_scheduler": "slurm"})
    assert proc.returncode != 0
    assert "slurm_controller" in proc.stdout
    proc = _run(tmp_path, [*GROUPS, "slurm_controller"], {"shardstack_scheduler": "slurm"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
