"""`shardstack_accelerator`: the accelerator class (the wheelhouse) of a node, decided by shardstack.accel.

    {{ shardstack_hardware | shardstack_accelerator(nvidia_driver_branch, shardstack_accelerator | default('auto')) }}
    → {"accelerator": "cu130", "reason": "NVIDIA GPU(s), driver branch 580 …"}

A driver branch no torch build runs fails the task with the cause and the fix. The decision is the Python
package's, so Ansible, the CLI and the runtime cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError


def accelerator(hardware: Mapping[str, Any], driver_branch: str | int | None = None,
                override: str | None = None) -> dict[str, str]:
    from shardstack.accel import AcceleratorError, accelerator_class

    try:
        return accelerator_class(hardware, driver_branch, override).to_dict()
    except AcceleratorError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_accelerator": accelerator}
