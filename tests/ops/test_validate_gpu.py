"""validate on GPU nodes: each broken condition, from the facts a node publishes (`python -m shardstack.accel`),
is a finding that names the node and the check; a CPU node passes with "no NVIDIA hardware". And the GPU,
all-reduce and storage plays of playbooks/validate.yml, run for real on this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from shardstack.accel import probe
from shardstack.cli.deploy import _gpu_cell
from shardstack.ops.runner import run_playbook
from shardstack.ops.validate import gpu_findings, validate_findings

H200 = "NVIDIA H200, 580.65.06, 143771 MiB"


def published(*, train: bool = True, **facts: Any) -> dict[str, Any]:
    """What the GPU play publishes for one node whose probe reported `facts` (a healthy 2 × H200 node by default)."""
    base = {"gpus": ["0000:19:00.0", "0000:3b:00.0"], "nvidia_functions": 2,
            "device_nodes": ["/dev/nvidia0", "/dev/nvidia1"], "driver_version": "580.65.06",
            "nvidia_smi": "/usr/bin/nvidia-smi", "smi_rc": 0, "smi_output": [H200, H200], "torch_version": "2.13.0",
            "torch_cuda": "13.0", "cuda_available": True, "cuda_devices": ["NVIDIA H200", "NVIDIA H200"],
            "dcgm_rc": 0, "dcgm_output": ["|  Deployment  | Pass |"]}
    return {"accel": {"facts": {**base, **facts}, "accelerator": "cu130"}, "train_node": train, "nccl_conf": []}


CPU_NODE = {"accel": {"facts": {"torch_version": "2.13.0+cpu", "nvidia_smi": None}, "accelerator": "cpu"},
            "train_node": True, "nccl_conf": []}
NCCL = {"backend": "nccl", "correct": True}

BROKEN = {
    "driver: nvidia-smi missing": (
        published(nvidia_smi=None, smi_rc=None, smi_output=[], driver_version=None, cuda_available=False,
                  cuda_devices=[], cuda_error="Found no NVIDIA driver on your system. Please check that you have an "
                  "NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx"),
        ["gpu1: driver: the NVIDIA kernel module is not loaded", "gpu1: driver: nvidia-smi is not installed",
         "gpu1: cuda: torch 2.13.0 (CUDA 13.0) cannot initialise CUDA: Found no NVIDIA driver on your system"]),
    "driver: nvidia-smi fails": (
        published(smi_rc=9, smi_output=["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                        "driver. Make sure that the latest NVIDIA driver is installed and running."]),
        ["gpu1: driver: nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate"]),
    "torch build: CPU build": (
        published(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=None, cuda_devices=[]),
        ["gpu1: torch build: torch 2.13.0+cpu is a CPU build"]),
    "cuda: cannot initialise": (
        published(cuda_available=False, cuda_devices=[], cuda_error="CUDA error: system not yet initialized"),
        ["gpu1: cuda: torch 2.13.0 (CUDA 13.0) cannot initialise CUDA: CUDA error: system not yet initialized"]),
    "cuda: runtime newer than the driver": (
        published(driver_version="570.124.06", cuda_available=False, cuda_devices=[]),
        ["gpu1: cuda: torch 2.13.0 is built for CUDA 13.0, newer than driver 570.124.06 runs (CUDA ≤ 12.8)"]),
    "dcgm: diag fails": (
        published(dcgm_rc=226, dcgm_output=["|  Deployment  | Fail |", "| GPU Memory | Fail - All |",
                                            "Error: GPU 1 had uncorrectable memory errors"]),
        ["gpu1: dcgm: `dcgmi diag -r 1` failed (exit 226): |  Deployment  | Fail |"]),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_gpu_node_fails_validate_naming_the_check(case: str) -> None:
    report, expected = BROKEN[case]
    findings = validate_findings({"validate_gpu": {"gpu1": report, "cpu1": CPU_NODE}, "validate_allreduce": NCCL,
                                  "validate_storage": {"gpu1": {"peer_checksum_matches": True}},
                                  "validate_inference": {"status": 200}})
    assert len(findings) == len(expected)
    for want, got in zip(expected, findings, strict=True):
        assert got.startswith(want), got


def test_healthy_gpu_and_cpu_nodes_pass() -> None:
    assert gpu_findings({"gpu1": published(), "cpu1": CPU_NODE}, NCCL) == []
    assert _gpu_cell(CPU_NODE) == "no NVIDIA hardware (CPU node), torch 2.13.0+cpu"
    assert _gpu_cell(published()) == f"{H200}\n{H200}\ndriver 580.65.06, torch 2.13.0 (CUDA ok), DCGM diag passed"


def test_the_all_reduce_on_gloo_fails_a_cluster_with_gpu_train_nodes() -> None:
    gloo = {"backend": "gloo", "correct": True}
    assert gpu_findings({"gpu1": published(), "cpu1": CPU_NODE}, gloo) == [
        "backend: the all-reduce ran on gloo, not NCCL, although train node(s) gpu1 have NVIDIA GPUs"]
    assert gpu_findings({"gpu1": published(train=False), "cpu1": CPU_NODE}, gloo) == []  # inference-only GPUs
    assert gpu_findings({"cpu1": CPU_NODE}, gloo) == []


def test_pcie_problems_are_findings() -> None:
    report = {**published(), "pcie_problems": ["0000:05:00.0 (PCIe switch port): ACS SrcValid+ redirects peer traffic"]}
    assert gpu_findings({"gpu1": report}, NCCL) == [
        "gpu1: pcie: 0000:05:00.0 (PCIe switch port): ACS SrcValid+ redirects peer traffic"]


def test_a_node_whose_probe_did_not_run_is_a_finding() -> None:
    report = {"accel": {}, "accel_error": "[Errno 2] No such file or directory: b'/opt/shardstack/venv/bin/python'",
              "train_node": True}
    assert gpu_findings({"n1": report}, None) == [
        "n1: node facts: `python -m shardstack.accel` gave no result: [Errno 2] No such file or directory: "
        "b'/opt/shardstack/venv/bin/python'"]


def test_the_gpu_and_all_reduce_plays_on_this_machine(tmp_path: Path) -> None:
    inv = tmp_path / "hosts.yml"
    groups = ["train_nodes", "inference_nodes", "storage_server", "monitoring_server", "loadbalancer"]
    inv.write_text(json.dumps({"all": {
        "hosts": {"node1": {"ansible_host": "127.0.0.1"}},
        # ansible_user: the login user, so that Mitogen skips become (sudo) as plain Ansible does.
        "vars": {"ansible_connection": "local", "ansible_user": "root", "ansible_python_interpreter": sys.executable},
        "children": {g: {"hosts": {"node1": {}}} for g in groups[:2]} | {g: {"hosts": {}} for g in groups[2:]},
    }}))
    # A floor no link reaches: the sweep still runs and reports every size; validate fails on the floor alone.
    res = run_playbook("playbooks/validate.yml", inv, tags="validate_gpu,validate_allreduce",
                       extravars={"validate_venv": sys.prefix, "validate_allreduce_mb": 2, "validate_rdzv_port": 29471,
                                  "validate_allreduce_busbw_min": 1e9},
                       artifacts=tmp_path / "art")
    assert res.success, res.hosts
    report = res.data["validate_gpu"]["node1"]
    here = probe(torch_facts=False)
    assert report["accel"]["facts"]["gpus"] == here.gpus and report["train_node"] is True
    ar = res.data["validate_allreduce"]
    assert ar["correct"] is True and [row["bytes"] for row in ar["sweep"]] == [2**20, 2**21]
    assert all(row["correct"] and row["busbw_gbps"] > 0 for row in ar["sweep"])
    assert ar["world_size"] == max(len(here.gpus), 1) and ar["below_floor"] is True
    assert [f for f in validate_findings(res.data) if f.startswith("all-reduce")] == [
        f"all-reduce: bus bandwidth {ar['busbw_gbps']:.2f} Gbit/s at 2 MiB over {ar['world_size']} rank(s) on "
        f"{ar['backend']} is below the floor of 1e+09 Gbit/s (validate_allreduce_busbw_min)"]
    findings = gpu_findings(res.data["validate_gpu"], ar)
    if not here.has_nvidia:
        assert report["accel"]["accelerator"] == "cpu" and findings == []
        assert res.data["validate_allreduce"]["backend"] == "gloo"
        assert _gpu_cell(report).startswith("no NVIDIA hardware (CPU node)")


def test_the_storage_play_checks_the_reachable_nodes_when_one_is_unreachable(tmp_path: Path) -> None:
    """An unreachable node is reported as such; the others' storage check runs without it (it has no mount fact)."""
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"node1": {"ansible_connection": "local", "ansible_host": "127.0.0.1"},
                  # Nothing listens on port 1: refused at once.
                  "node2": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}},
        "vars": {"ansible_user": "root", "ansible_python_interpreter": sys.executable},
        "children": {"train_nodes": {"hosts": {"node1": {}, "node2": {}}}},
    }}))
    shared = tmp_path / "shared"
    shared.mkdir()
    res = run_playbook("playbooks/validate.yml", inv, tags="validate_storage", artifacts=tmp_path / "art",
                       extravars={"validate_shared_dir": str(shared), "validate_storage_mb": 1,
                                  "shardstack_user": "root", "shardstack_group": "root"})
    assert res.hosts["node2"].unreachable and not res.hosts["node1"].failed, res.hosts
    assert set(res.data["validate_storage"]) == {"node1"}
    report = res.data["validate_storage"]["node1"]
    assert set(report) == {"read_only", "write", "read_of", "read", "peer_checksum_matches"}, report
    assert report["read_only"] is False and report["read_of"] == "node1" and report["peer_checksum_matches"] is True
    assert "copied" in report["write"]
