"""`shardstack_accelerator`: the accelerator class (the wheelhouse) of a node, decided by shardstack.accel.

    {{ shardstack_hardware | shardstack_accelerator(nvidia_driver_branch, shardstack_accelerator | default('auto')) }}
    → {"accelerator": "cu130", "reason": "NVIDIA GPU(s), driver branch 580 …"}
    {{ "580" | shardstack_driver_cuda }} → "13.0" (the newest CUDA the branch runs; "" below the table)

A driver branch no torch build runs fails the task with the cause and the fix, or with strict=false gives
{"accelerator": None, "reason": <cause and fix>} for an assert to report. The decision is the Python package's, so
Ansible, the CLI and the runtime cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError


def accelerator(hardware: Mapping[str, Any], driver_branch: str | int | None = None,
                override: str | None = None, strict: bool = True) -> dict[str, str | None]:
    from shardstack.accel import AcceleratorError, accelerator_class

    try:
        return dict(accelerator_class(hardware, driver_branch, override).to_dict())
    except AcceleratorError as exc:
        if strict:
            raise AnsibleFilterError(str(exc)) from None
        return {"accelerator": None, "reason": str(exc)}


def driver_cuda(driver_branch: str | int | None) -> str:
    from shardstack.accel import AcceleratorError, driver_cuda, parse_branch

    try:
        branch = parse_branch(driver_branch)
    except AcceleratorError as exc:
        raise AnsibleFilterError(str(exc)) from None
    cuda = driver_cuda(branch) if branch is not None else None
    return f"{cuda[0]}.{cuda[1]}" if cuda else ""


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_accelerator": accelerator, "shardstack_driver_cuda": driver_cuda}
