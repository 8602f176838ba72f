"""The shardstack_accelerator filter (playbooks/filter_plugins) inside a real play: how a role learns a node's
accelerator class from the preflight's hardware facts and nvidia_driver_branch, and how a bad branch fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardstack.ops.runner import run_playbook

GPU = {"nvidia_pci_functions": ["/sys/bus/pci/devices/0000:18:00.0/vendor"], "nvidia_device_nodes": []}
CPU = {"nvidia_pci_functions": [], "nvidia_device_nodes": []}


def test_each_node_gets_its_class_and_a_bad_branch_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ANSIBLE_FILTER_PLUGINS", str(Path(__file__).parents[2] / "playbooks" / "filter_plugins"))
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"gpu580": {"hw": GPU, "branch": "580"}, "gpu575": {"hw": GPU, "branch": "575"},
                  "cpu": {"hw": CPU, "branch": "535"}, "forced": {"hw": GPU, "branch": "535", "override": "cu126"},
                  "gpu535": {"hw": GPU, "branch": "535"}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    res = run_playbook("tests/ops/playbooks/accelerator_class.yml", inv, artifacts=tmp_path / "art")
    got = {h: d["accelerator"] for h, d in res.data["accelerator"].items()}
    assert got == {"gpu580": "cu130", "gpu575": "cu129", "cpu": "cpu", "forced": "cu126"}
    failed = res.hosts["gpu535"]
    assert failed.failed and "driver branch 535 supports CUDA ≤ 12.2; torch 2.13.0 ships cu126" in failed.message
    assert "install driver branch ≥ 560 (nvidia_driver_branch" in failed.message


def test_the_preflights_compatibility_check_on_gpu_nodes(tmp_path: Path, monkeypatch) -> None:
    """nvidia_driver's compatibility.yml, which site.yml's preflight imports: the role's default branch (580) runs
    cu130 natively, Debian 12's 535 fails naming the fix unless cu126 is pinned, a CPU node skips the table."""
    monkeypatch.setenv("ANSIBLE_FILTER_PLUGINS", str(Path(__file__).parents[2] / "playbooks" / "filter_plugins"))
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"gpu_default": {"hw": GPU}, "gpu535": {"hw": GPU, "nvidia_driver_branch": "535"},
                  "gpu535_cu126": {"hw": GPU, "nvidia_driver_branch": "535", "shardstack_accelerator": "cu126"},
                  "cpu535": {"hw": CPU, "nvidia_driver_branch": "535"}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    res = run_playbook("tests/ops/playbooks/compatibility.yml", inv, artifacts=tmp_path / "art")
    got = {h: (d["accelerator"], d["driver_cuda"]) for h, d in res.data["compat"].items()}
    assert got == {"gpu_default": ("cu130", "13.0"), "gpu535_cu126": ("cu126", "12.2"), "cpu535": ("cpu", "12.2")}
    assert "minor-version compatibility only" in res.data["compat"]["gpu535_cu126"]["reason"]
    failed = res.hosts["gpu535"]
    assert failed.failed and failed.failed_task == "Compatibility - a torch build runs on this driver branch"
    assert failed.message.startswith("gpu535: driver branch 535 supports CUDA ≤ 12.2; torch 2.13.0 ships cu126")
    assert ("hint: install driver branch ≥ 560 (nvidia_driver_branch, from NVIDIA's repository: nvidia_driver_source: "
            "cuda_repo), or pin a build this driver runs by minor-version compatibility (shardstack_accelerator: "
            "cu126") in " ".join(failed.message.split())
