"""`shardstack artifacts prune` from the controller: playbooks/artifacts_prune.yml runs the policy
(shardstack.node.artifacts) on the first storage_server and publishes its report, read back here as a typed plan."""

from __future__ import annotations

from collections.abc import Callable

from shardstack.errors import ShardstackError
from shardstack.node.artifacts import Item, Plan
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import RunnerEvent, RunResult, run_playbook


def prune(cluster: Cluster, *, keep_exports: int = 3, older_than_days: float = 7.0,
          dry_run: bool = True, on_event: Callable[[RunnerEvent], None] | None = None) -> tuple[Plan, RunResult]:
    if keep_exports < 0 or older_than_days < 0:
        raise ShardstackError("--keep-exports and --older-than must not be negative")
    res = run_playbook("playbooks/artifacts_prune.yml", cluster.path, extravars={
        "artifacts_shared_dir": cluster.shared_dir, "artifacts_keep_exports": keep_exports,
        "artifacts_older_than_days": older_than_days, "artifacts_dry_run": dry_run}, on_event=on_event)
    report = res.data.get("artifacts_prune")
    if not isinstance(report, dict):
        failed = next((h for h in res.hosts.values() if not h.success), None)
        raise ShardstackError("the prune did not report back" + (f": {failed.host}: {failed.message}" if failed else
                                                                 " (no storage_server host matched?)"),
                              hint=f"ansible-runner artifacts: {res.artifact_dir}")
    return plan_from_report(report), res


def plan_from_report(report: dict) -> Plan:
    p = Plan(report["shared_dir"], int(report["keep_exports"]), float(report["older_than_days"]),
             bool(report["dry_run"]))
    p.items = [Item(**i) for i in report.get("items", [])]
    p.deleted = list(report.get("deleted", []))
    p.errors = list(report.get("errors", []))
    return p
