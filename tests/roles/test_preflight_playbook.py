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


def _listed(tmp_path: Path, tags: str) -> list[str]:
    """site.yml's tasks that `--tags TAGS` selects (`--list-tasks`), as "role : name" or "name"."""
    proc = _run(tmp_path, GROUPS, {}, "../site.yml", "--list-tasks", "--tags", tags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split("\tTAGS:")[0].strip() for line in proc.stdout.splitlines()
            if "\tTAGS:" in line and not line.lstrip().startswith("play #")]


def test_a_run_of_one_stages_tags_runs_site_preflight_and_that_stages_preflights_only(tmp_path: Path) -> None:
    """A role's preflight follows its stage's and its own tags (not `always`): `--tags loadbalancer` (revoking a key)
    runs site.yml's preflight and the load balancer's, not the ~100 preflight tasks of every other role."""
    listed = _listed(tmp_path, "loadbalancer")
    preflights = {t.split(" : ")[0] for t in listed if " : Preflight - " in t}
    assert preflights == {"loadbalancer"}, listed
    assert "shardstack_common : Hardware - probe PCI functions, GPU device nodes and RDMA devices" in listed
    assert "Preflight - no unknown role or shardstack variables" in listed
    # The stage's plays skip their fact gathering (it carries their tags): site.yml's preflight gathers for them.
    assert "Preflight - gather the facts a run of other tags skipped" in listed
    # One step of a role still runs that role's preflight: the firewall's lockout guard before its ruleset.
    guard = "firewall : Preflight - the ruleset keeps this ssh connection open"
    assert guard in _listed(tmp_path, "firewall_configure")
    # Prometheus' scrape targets read the DCGM exporter's gating decision, recorded by that role's preflight.
    gate = "dcgm_exporter : Preflight - record the gating decision for the scrape targets"
    assert gate in _listed(tmp_path, "prometheus")
