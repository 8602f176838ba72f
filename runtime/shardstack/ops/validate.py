"""`shardstack validate`: the post-deploy checks (playbooks/validate.yml) and what their published measurements
say failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardstack.ops.runner import RunnerEvent, RunResult, run_playbook


def validate_findings(data: dict[str, Any]) -> list[str]:
    """What failed in validate.yml's published measurements (empty = everything passed)."""
    bad = []
    ar = data.get("validate_allreduce")
    if not ar:
        bad.append("all-reduce: no result")
    elif not ar.get("correct"):
        bad.append("all-reduce: wrong sum")
    for host, st in (data.get("validate_storage") or {}).items():
        if not st.get("peer_checksum_matches"):
            bad.append(f"storage: {host} read different bytes than {st.get('read_of')} wrote")
    if not data.get("validate_storage"):
        bad.append("storage: no result")
    inf = data.get("validate_inference")
    if not inf:
        bad.append("inference: no result")
    elif int(inf.get("status", -1)) != 200:
        bad.append(f"inference: load balancer answered {inf.get('status')}")
    return bad


def run_validate(inventory: Path, *, allreduce_mb: float = 16.0, limit: str | None = None,
                 extravars: dict[str, Any] | None = None,
                 on_event: Callable[[RunnerEvent], None] | None = None) -> tuple[RunResult, list[str]]:
    result = run_playbook("playbooks/validate.yml", inventory, limit=limit,
                          extravars={**(extravars or {}), "validate_allreduce_mb": allreduce_mb}, on_event=on_event)
    return result, validate_findings(result.data)
