"""nvidia_driver's preflight checks on recorded node state: Secure Boot (mokutil, the EFI variable), PCIe ACS and
IOMMU (lspci -vvv, /proc/cmdline)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"

GPU = "/sys/bus/pci/devices/0000:3b:00.0/vendor"


def _bare_metal(facts: dict[str, Any]) -> dict[str, Any]:
    return {**facts, "virtualization_type": "", "virtualization_role": ""}


def _efivar(value: int, attributes: int = 0x06) -> str:
    """/sys/firmware/efi/efivars/SecureBoot-8be4df61-…, as slurp returns it: 4 attribute bytes, then the value."""
    return base64.b64encode(attributes.to_bytes(4, "little") + bytes([value])).decode()


def _task(file: str, name: str) -> dict[str, Any]:
    tasks = yaml.safe_load((ROLES / "nvidia_driver/tasks" / file).read_text())
    return next(task for task in tasks if task["name"] == name)


# Recorded: mokutil 0.6.0 on Debian 12 (enabled; disabled; a BIOS boot), and the EFI variable where mokutil is
# not installed (the command module's failure for a missing executable: no stdout).
@pytest.mark.parametrize(
    ("mokutil", "efivar", "state"),
    [
        ("SecureBoot enabled\n", "", "on"),
        ("SecureBoot disabled\n", "", "off"),
        ("SecureBoot disabled\nPlatform is in Setup Mode\n", "", "off"),
        ("EFI variables are not supported on this system\n", "", "unknown"),
        ("", _efivar(1), "on"),
        ("", _efivar(0), "off"),
        ("", _efivar(1, attributes=0x07), "on"),
        ("", "", "unknown"),
        ("", "not base64!", "unknown"),
    ],
)
def test_secure_boot_state(role_eval: Any, hardware: Any, debian_container: dict, mokutil: str, efivar: str,
                           state: str) -> None:
    r = role_eval("nvidia_driver", _bare_metal(debian_container), shardstack_hardware=hardware(pci=(GPU,)),
                  __nvidia_driver_mokutil={"stdout": mokutil, "rc": 0 if mokutil.startswith("SecureBoot") else 1},
                  __nvidia_driver_sb_var={"content": efivar} if efivar else {"failed": True})
    assert r["__nvidia_driver_secure_boot"] == state


@pytest.mark.parametrize(
    ("state", "enrolled", "container", "loaded", "passes"),
    [
        ("SecureBoot enabled\n", False, False, False, False),  # unsigned modules would never load: stop here
        ("SecureBoot enabled\n", True, False, False, True),  # DKMS signs with the enrolled MOK
        ("SecureBoot disabled\n", False, False, False, True),
        ("", False, False, False, True),  # unknown (BIOS boot, nothing readable): nothing to refuse
        ("SecureBoot enabled\n", False, True, False, True),  # a container: the host owns the modules, no check
        # A module loaded under Secure Boot: DKMS's key is enrolled (it signs the next build, any flavour, too).
        ("SecureBoot enabled\n", False, False, True, True),
    ],
)
def test_secure_boot_fails_a_node_whose_modules_would_not_load(
    role_eval: Any, hardware: Any, debian_container: dict, state: str, enrolled: bool, container: bool, loaded: bool,
    passes: bool
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval("nvidia_driver", facts, shardstack_hardware=hardware(pci=(GPU,)),
                  __nvidia_driver_sb_module={"stat": {"exists": loaded}},
                  __nvidia_driver_mokutil={"stdout": state, "rc": 0}, nvidia_driver_secure_boot_mok_enrolled=enrolled)
    check = _task("secure_boot_checks.yml", "Secure Boot - the DKMS-built modules can load")
    applies = r[check["when"]]
    assert applies is (not container and not loaded)
    assert (not applies or r[check["ansible.builtin.assert"]["that"]]) is passes
    if not passes:
        message = r.template(check["ansible.builtin.assert"]["fail_msg"])
        assert message.startswith("node1: Secure Boot is on, so the kernel refuses the nvidia modules DKMS builds")
        assert "mokutil --import /var/lib/dkms/mok.pub" in message
        assert message.endswith("set nvidia_driver_secure_boot_mok_enrolled=true")


def test_secure_boot_is_checked_before_anything_changes() -> None:
    """site.yml's preflight imports the check (all tags) after the hardware probe, before any stage."""
    plays = yaml.safe_load((ROLES.parent / "playbooks/preflight.yml").read_text())
    tasks = [t for play in plays for t in play.get("tasks", [])]
    names = [t.get("ansible.builtin.import_role", {}).get("tasks_from") for t in tasks]
    assert names.index("secure_boot.yml") > names.index("hardware.yml")
    task = tasks[names.index("secure_boot.yml")]
    assert task["ansible.builtin.import_role"]["name"] == "nvidia_driver" and task["tags"] == ["always"]


# lspci -vvv of an HGX H100 node (trimmed to the lines that matter): a root port with ACS on (the kernel's, for the
# IOMMU groups: never flagged), a PEX890xx switch (upstream port, two downstream ports with ACS redirecting P2P), a
# GPU and a ConnectX-7 behind it.
LSPCI_ACS_ON = (Path(__file__).parent / "fixtures/lspci-vvv-hgx-h100.txt").read_text()
# The same switch after `setpci -s 17:00.0 ECAP_ACS+0x6.w=0000` (and 17:01.0), or with ACS off in the firmware.
_ON = "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-\n"
_OFF = "\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-\n"
_SWITCH_PORTS = ("17:00.0 PCI bridge", "17:01.0 PCI bridge")
LSPCI_ACS_OFF = "\n\n".join(block.replace(_ON, _OFF) if block.startswith(_SWITCH_PORTS) else block
                             for block in LSPCI_ACS_ON.split("\n\n"))
CMDLINE = "BOOT_IMAGE=/boot/vmlinuz-6.1.0-28-amd64 root=UUID=0f1e ro quiet"


def _pcie(role_eval: Any, hardware: Any, facts: dict, lspci: str, cmdline: str, rc: int = 0, **kw: Any) -> Any:
    return role_eval("nvidia_driver", facts, shardstack_hardware=hardware(pci=(GPU,)),
                     __nvidia_driver_lspci={"stdout": lspci, "rc": rc},
                     __nvidia_driver_cmdline={"content": base64.b64encode(cmdline.encode()).decode()}, **kw)


def test_the_fixture_has_acs_on_only_where_the_test_says() -> None:
    assert LSPCI_ACS_OFF.count("ACSCtl:\tSrcValid+") == 1  # the root port's alone
    assert LSPCI_ACS_ON.count("ACSCtl:\tSrcValid+") == 3


@pytest.mark.parametrize(
    ("lspci", "cmdline", "problems"),
    [
        (LSPCI_ACS_OFF, CMDLINE, []),
        (LSPCI_ACS_ON, CMDLINE, ["ACS is enabled on PCIe switch port(s) 17:00.0 (SrcValid+ ReqRedir+ CmpltRedir+), "
                                 "17:01.0 (SrcValid+ ReqRedir+ CmpltRedir+)"]),
        (LSPCI_ACS_OFF, CMDLINE + " intel_iommu=on", ["the kernel command line has intel_iommu=on without iommu=pt"]),
        (LSPCI_ACS_OFF, CMDLINE + " intel_iommu=on,sm_on", ["the kernel command line has intel_iommu=on without"]),
        (LSPCI_ACS_OFF, CMDLINE + " intel_iommu=on iommu=pt", []),
        (LSPCI_ACS_OFF, CMDLINE + " intel_iommu=on iommu.passthrough=1", []),
        (LSPCI_ACS_OFF, CMDLINE + " intel_iommu=off", []),
        (LSPCI_ACS_ON, CMDLINE + " intel_iommu=on", ["ACS is enabled on PCIe switch port(s) 17:00.0",
                                                     "the kernel command line has intel_iommu=on without iommu=pt"]),
    ],
)
def test_pcie_acs_and_iommu_on_recorded_state(role_eval: Any, hardware: Any, debian_container: dict, lspci: str,
                                              cmdline: str, problems: list) -> None:
    r = _pcie(role_eval, hardware, _bare_metal(debian_container), lspci, cmdline)
    found = r["__nvidia_driver_pcie"]["problems"]
    assert len(found) == len(problems)
    for problem, expected in zip(found, problems, strict=True):
        assert problem.startswith(expected)
    check = _task("pcie.yml", "PCIe - peer-to-peer is neither redirected (ACS) nor translated (IOMMU)")
    assert r[check["when"]] is True
    assert r[check["ansible.builtin.assert"]["that"]] is (not problems)
    # warn (validate.yml's mode): reported, the node goes on.
    warn = _pcie(role_eval, hardware, _bare_metal(debian_container), lspci, cmdline, nvidia_driver_pcie_check="warn")
    assert warn[check["ansible.builtin.assert"]["that"]] is True
    if problems:
        message = r.template(check["ansible.builtin.assert"]["fail_msg"])
        assert message.startswith("node1: ") and "nvidia_driver_pcie_check=warn" in message
        assert ("setpci -s <port> ECAP_ACS+0x6.w=0000" in message) is ("ACS" in problems[0])
        assert "WARNING " in warn.template(check["ansible.builtin.assert"]["success_msg"])


def test_pcie_without_lspci_checks_the_iommu_only(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = _pcie(role_eval, hardware, _bare_metal(debian_container), "", CMDLINE, rc=2)
    assert r["__nvidia_driver_pcie"] == {"problems": [], "report": [
        "ACS not checked: lspci -vvv failed (install pciutils)",
        "IOMMU not translating DMA (no intel_iommu=on, or iommu=pt)"]}


@pytest.mark.parametrize(("overrides", "gpu", "applies"), [
    ({"virtualization_type": "", "virtualization_role": ""}, True, True),
    ({"virtualization_type": "", "virtualization_role": "host"}, True, True),  # KVM host: still bare metal
    ({"virtualization_type": "kvm", "virtualization_role": "guest"}, True, False),  # passthrough needs ACS/IOMMU
    ({}, True, False),  # the container fixture
    ({"virtualization_type": "", "virtualization_role": ""}, False, False),  # no GPU
])
def test_pcie_check_only_on_bare_metal_gpu_hosts(role_eval: Any, hardware: Any, debian_container: dict,
                                                 overrides: dict, gpu: bool, applies: bool) -> None:
    r = role_eval("nvidia_driver", {**debian_container, **overrides},
                  shardstack_hardware=hardware(pci=(GPU,) if gpu else ()))
    assert r["__nvidia_driver_pcie_applies"] is applies
    skip = role_eval("nvidia_driver", {**debian_container, **overrides},
                     shardstack_hardware=hardware(pci=(GPU,) if gpu else ()), nvidia_driver_pcie_check="skip")
    assert skip["__nvidia_driver_pcie_applies"] is False


def test_pcie_checked_in_preflight_and_reported_by_validate() -> None:
    plays = yaml.safe_load((ROLES.parent / "playbooks/preflight.yml").read_text())
    tasks = [t for play in plays for t in play.get("tasks", [])]
    froms = [t.get("ansible.builtin.import_role", {}).get("tasks_from") for t in tasks]
    assert froms.index("pcie.yml") > froms.index("hardware.yml")
    validate = yaml.safe_load((ROLES.parent / "playbooks/validate.yml").read_text())[0]
    include = next(t for t in validate["tasks"] if t.get("ansible.builtin.include_role", {}).get("tasks_from")
                   == "pcie.yml")
    assert include["vars"] == {"nvidia_driver_pcie_check": "warn"} and include["ansible.builtin.include_role"]["public"]
    publish = next(t for t in validate["tasks"] if "ansible.builtin.set_stats" in t)
    assert publish["vars"]["__report"]["pcie_problems"] == "{{ __nvidia_driver_pcie.problems | default([]) }}"
