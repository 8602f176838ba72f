"""Hardware gating (docs/roles.md): the decision each role takes from what the shardstack_common probe found (the
fact `shardstack_hardware`), and the reason it prints."""

from __future__ import annotations

import base64
from typing import Any

import pytest

GPU = "/sys/bus/pci/devices/0000:3b:00.0/vendor"
IB = "/sys/class/infiniband/mlx5_0"


def _bare_metal(facts: dict[str, Any]) -> dict[str, Any]:
    return {**facts, "virtualization_type": "", "virtualization_role": ""}


@pytest.mark.parametrize(
    ("pci", "force", "container", "modules", "enabled", "kernel", "reason"),
    [
        ([], False, True, "auto", False, False, "skipped: no NVIDIA GPU found"),
        ([], True, True, "auto", True, False, "userspace only (forced); kernel-module steps skipped: container"),
        ([GPU], False, True, "auto", True, False, "userspace only (GPU found); kernel-module steps skipped: container"),
        ([GPU], False, False, "auto", True, True, "full install (1 NVIDIA PCI device(s))"),
        ([GPU], False, False, "never", True, False, "kernel-module steps skipped: nvidia_driver_kernel_modules=never"),
        ([], True, True, "always", True, True, "full install (0 NVIDIA PCI device(s), forced)"),
    ],
)
def test_nvidia_driver_gate(
    role_eval: Any,
    hardware: Any,
    debian_container: dict,
    pci: list,
    force: bool,
    container: bool,
    modules: str,
    enabled: bool,
    kernel: bool,
    reason: str,
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval(
        "nvidia_driver",
        facts,
        shardstack_hardware=hardware(pci=tuple(pci)),
        nvidia_driver_force=force,
        nvidia_driver_kernel_modules=modules,
    )
    assert r["__nvidia_driver_enabled"] is enabled
    assert r["__nvidia_driver_kernel"] is kernel
    assert reason in r["__nvidia_driver_reason"]


@pytest.mark.parametrize(("force", "enabled"), [("true", True), ("false", False)])
def test_nvidia_driver_force_given_as_string_on_the_command_line(
    role_eval: Any, hardware: Any, debian_container: dict, force: str, enabled: bool
) -> None:
    # `-e nvidia_driver_force=true` arrives as a string.
    r = role_eval("nvidia_driver", debian_container, shardstack_hardware=hardware(), nvidia_driver_force=force)
    assert r["__nvidia_driver_enabled"] is enabled


def test_nvidia_device_node_counts_as_gpu(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("nvidia_driver", debian_container, shardstack_hardware=hardware(devnodes=("/dev/nvidia0",)))
    assert r["__nvidia_driver_gpu_found"] is True


@pytest.mark.parametrize(
    ("loaded", "branch", "version", "left_alone"),
    [
        ("535.183.01\n", "535", "", True),
        ("535.183.01\n", "550", "", False),
        ("535.183.01\n", "535", "535.183.01-1", True),
        ("535.183.01\n", "535", "535.216.03-1", False),
        ("", "535", "", False),
    ],
)
def test_nvidia_loaded_matching_driver_is_left_alone(
    role_eval: Any, hardware: Any, debian_container: dict, loaded: str, branch: str, version: str, left_alone: bool
) -> None:
    module = {"content": base64.b64encode(loaded.encode()).decode()} if loaded else {}
    r = role_eval(
        "nvidia_driver",
        _bare_metal(debian_container),
        shardstack_hardware=hardware(pci=(GPU,)),
        __nvidia_driver_module_version=module,
        nvidia_driver_branch=branch,
        nvidia_driver_version=version,
    )
    assert r["__nvidia_driver_loaded_matches"] is left_alone
    assert r["__nvidia_driver_install"] is (not left_alone)
    if left_alone:
        assert "left alone" in r["__nvidia_driver_reason"]


@pytest.mark.parametrize(
    ("source", "kernel_pkg"),
    [("distro", "nvidia-kernel-dkms"), ("cuda_repo", "cuda-drivers-535")],
)
def test_nvidia_packages_by_source(role_eval: Any, debian_container: dict, source: str, kernel_pkg: str) -> None:
    r = role_eval("nvidia_driver", debian_container, nvidia_driver_source=source)
    assert kernel_pkg in r["__nvidia_driver_kernel_effective"]
    assert r["__nvidia_driver_userspace_effective"] == ["nvidia-smi", "libnvidia-ml1"]


def test_nvidia_ubuntu_and_rhel_dispatch(role_eval: Any, debian_container: dict) -> None:
    ubuntu = {**debian_container, "distribution": "Ubuntu", "distribution_version": "22.04"}
    r = role_eval("nvidia_driver", ubuntu)
    assert r["__nvidia_driver_userspace_effective"][0] == "nvidia-utils-535-server"
    rhel = {**debian_container, "distribution": "Rocky", "os_family": "RedHat", "distribution_major_version": "9"}
    r = role_eval("nvidia_driver", rhel, nvidia_driver_source="cuda_repo")
    assert "@nvidia-driver:535-dkms" in r["__nvidia_driver_kernel_effective"]


@pytest.mark.parametrize(("pci", "force", "enabled"), [([], False, False), ([], True, True), ([GPU], False, True)])
def test_cuda_toolkit_gate(
    role_eval: Any, hardware: Any, debian_container: dict, pci: list, force: bool, enabled: bool
) -> None:
    r = role_eval("cuda_toolkit", debian_container, shardstack_hardware=hardware(pci=tuple(pci)),
                  cuda_toolkit_force=force)
    assert r["__cuda_toolkit_enabled"] is enabled
    assert ("skipped: no NVIDIA GPU found" in r["__cuda_toolkit_reason"]) is (not enabled)


def test_cuda_repo_home_and_package(role_eval: Any, debian_container: dict) -> None:
    r = role_eval("cuda_toolkit", debian_container, cuda_toolkit_source="cuda_repo", cuda_toolkit_version="12.4")
    assert r["__cuda_toolkit_packages_effective"] == ["cuda-toolkit-12-4"]
    assert r["__cuda_toolkit_home"] == "/usr/local/cuda-12.4"


@pytest.mark.parametrize(
    ("ib", "force", "container", "enabled", "kernel", "peermem"),
    [
        ([], False, True, False, False, False),
        ([], True, True, True, False, False),
        (["/sys/class/infiniband/mlx5_0"], False, False, True, True, True),
        (["/sys/class/infiniband/mlx5_0"], False, True, True, False, False),
    ],
)
def test_rdma_gate(
    role_eval: Any,
    hardware: Any,
    debian_container: dict,
    ib: list,
    force: bool,
    container: bool,
    enabled: bool,
    kernel: bool,
    peermem: bool,
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval("rdma", facts, shardstack_hardware=hardware(pci=(GPU,), rdma=tuple(ib)), rdma_force=force)
    assert r["__rdma_enabled"] is enabled
    assert r["__rdma_kernel"] is kernel
    assert r["__rdma_peermem"] is peermem
    assert ("nvidia-peermem" in r["__rdma_modules_effective"]) is peermem
    if not enabled:
        assert r["__rdma_reason"].startswith("skipped: no RDMA device under /sys/class/infiniband")


def test_rdma_no_peermem_without_gpu(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("rdma", _bare_metal(debian_container), shardstack_hardware=hardware(rdma=(IB,)))
    assert r["__rdma_peermem"] is False
    assert r["__rdma_modules_effective"] == ["ib_uverbs", "rdma_ucm", "ib_umad"]


GATES = {  # role: the decisions it derives from shardstack_hardware
    "nvidia_driver": ["__nvidia_driver_enabled"],
    "cuda_toolkit": ["__cuda_toolkit_enabled"],
    "nccl": ["__nccl_install", "__nccl_ib_found"],
    "rdma": ["__rdma_enabled", "__rdma_gpu_found"],
    "dcgm_exporter": ["__dcgm_exporter_enabled"],
}


@pytest.mark.parametrize("role", sorted(GATES))
@pytest.mark.parametrize("present", [True, False], ids=["gpu+ib", "bare"])
def test_roles_gate_on_the_one_hardware_fact(
    role_eval: Any, hardware: Any, debian_container: dict, role: str, present: bool
) -> None:
    """The one probe (shardstack_common) decides for every role: no role keeps a probe of its own."""
    fact = hardware(pci=(GPU,), rdma=(IB,)) if present else hardware()
    r = role_eval(role, _bare_metal(debian_container), shardstack_hardware=fact)
    assert [r[d] for d in GATES[role]] == [present] * len(GATES[role])
    if role == "rdma":
        assert r["__rdma_devices"] == (["mlx5_0"] if present else [])


@pytest.mark.parametrize(
    ("container", "force", "kernel"), [(True, False, False), (True, True, True), (False, False, True)]
)
def test_shared_storage_nfs_gate(
    role_eval: Any, debian_container: dict, container: bool, force: bool, kernel: bool
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval(
        "shared_storage",
        facts,
        shared_storage_force=force,
        groups={"all": ["node1"], "storage_server": ["node1"]},
        hostvars={"node1": {}},
    )
    assert r["__shared_storage_nfs_kernel"] is kernel
    assert ("skipped: container" in r["__shared_storage_reason"]) is (not kernel)


FAMILIES = {
    "Debian": {},
    "Ubuntu": {"distribution": "Ubuntu", "distribution_version": "24.04", "distribution_major_version": "24"},
    "RedHat": {"distribution": "Rocky", "os_family": "RedHat", "distribution_major_version": "9"},
}
PACKAGE_VARS = {
    "os_baseline": "__os_baseline_packages_all",
    "nvidia_driver": "__nvidia_driver_userspace_effective",
    "cuda_toolkit": "__cuda_toolkit_packages[cuda_toolkit_source]",
    "nccl": "__nccl_packages_effective",
    "rdma": "__rdma_packages_effective",
    "shared_storage": "__shared_storage_nfs_client_packages",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("role", sorted(PACKAGE_VARS))
def test_every_os_family_resolves(role_eval: Any, debian_container: dict, role: str, family: str) -> None:
    facts = {**debian_container, **FAMILIES[family]}
    source = {"nvidia_driver_source": "cuda_repo", "cuda_toolkit_source": "cuda_repo"}
    overrides = {k: v for k, v in source.items() if k.startswith(role)}
    packages = role_eval(role, facts, **overrides)[PACKAGE_VARS[role]]
    assert isinstance(packages, list) and packages and all(isinstance(p, str) and p for p in packages)
