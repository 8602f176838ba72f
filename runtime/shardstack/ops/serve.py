"""`shardstack serve rollout`: upgrade the inference nodes one at a time behind the load balancer
(playbooks/rolling_upgrade.yml through ansible-runner)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardstack.ops.runner import RunResult, run_playbook


def rollout(inventory: Path, *, limit: str | None = None, extravars: dict[str, Any] | None = None,
            on_event=None) -> RunResult:
    return run_playbook("playbooks/rolling_upgrade.yml", inventory, limit=limit, extravars=extravars,
                        on_event=on_event)
