"""nvidia_driver's preflight checks on recorded node state: Secure Boot (mokutil, the EFI variable)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml
from conftest import ROLES

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
    ("state", "enrolled", "container", "passes"),
    [
        ("SecureBoot enabled\n", False, False, False),  # unsigned modules would never load: stop here
        ("SecureBoot enabled\n", True, False, True),  # DKMS signs with the enrolled MOK
        ("SecureBoot disabled\n", False, False, True),
        ("", False, False, True),  # unknown (BIOS boot, nothing readable): nothing to refuse
        ("SecureBoot enabled\n", False, True, True),  # a container: the host owns the modules, no check
    ],
)
def test_secure_boot_fails_a_node_whose_modules_would_not_load(
    role_eval: Any, hardware: Any, debian_container: dict, state: str, enrolled: bool, container: bool, passes: bool
) -> None:
    facts = debian_container if container else _bare_metal(debian_container)
    r = role_eval("nvidia_driver", facts, shardstack_hardware=hardware(pci=(GPU,)),
                  __nvidia_driver_mokutil={"stdout": state, "rc": 0}, nvidia_driver_secure_boot_mok_enrolled=enrolled)
    check = _task("secure_boot.yml", "Secure Boot - the DKMS-built modules can load")
    applies = r[check["when"]]
    assert applies is (not container)
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
