"""Fixtures for the role tests: a Debian 12 container's facts, find results, the hardware fact, the role evaluator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible_vars import RoleEval

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"

DEBIAN12_CONTAINER: dict[str, Any] = {
    "virtualization_type": "container",
    "architecture": "x86_64",
    "kernel": "6.1.0-28-amd64",
    "os_family": "Debian",
    "distribution": "Debian",
    "distribution_major_version": "12",
    "distribution_version": "12.8",
    "interfaces": ["lo", "eth0"],
    "eth0": {"device": "eth0", "ipv4": {"address": "10.0.0.11"}},
    "lo": {"device": "lo", "ipv4": {"address": "127.0.0.1"}},
    "default_ipv4": {},
}


def probed(pci: tuple[str, ...] = (), devnodes: tuple[str, ...] = (), rdma: tuple[str, ...] = (),
           nvswitch: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fact `shardstack_hardware` as the shardstack_common probe records it: the vendor files of the NVIDIA
    functions `pci` (GPUs) and `nvswitch`, their device directories by class, device nodes, RDMA devices."""
    return {"nvidia_pci_functions": [*pci, *(f"{d}/vendor" for d in nvswitch)],
            "nvidia_gpu_functions": [p.removesuffix("/vendor") for p in pci], "nvswitch_functions": list(nvswitch),
            "nvidia_device_nodes": list(devnodes), "rdma_devices": list(rdma)}


@pytest.fixture
def debian_container() -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEBIAN12_CONTAINER.items()}


@pytest.fixture
def role_eval() -> type[RoleEval]:
    return RoleEval


@pytest.fixture
def hardware() -> Any:
    return probed
