"""Scrape targets from the inventory: `prometheus_scrape_jobs | shardstack_scrape_targets(groups, hostvars)`.

Kept in Python rather than Jinja because the rules (group unions, first-host-only jobs, hardware gates, per-host
labels) need tests, and a filter can be imported and tested without a running play.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in TRUE_STRINGS
    return bool(value)


def _address(host: str, hostvars: Mapping[str, Any]) -> str:
    hv = hostvars.get(host, {})
    addr = str(hv.get("prometheus_target_address") or hv.get("ansible_host") or host)
    return f"[{addr}]" if ":" in addr else addr  # bare IPv6 literal


def _job_hosts(job: Mapping[str, Any], groups: Mapping[str, Sequence[str]],
               hostvars: Mapping[str, Any]) -> list[str]:
    hosts: list[str] = []
    for group in job.get("groups", []):
        for host in groups.get(group, []):
            if host not in hosts:  # a host in several groups is scraped once per job
                hosts.append(host)
    if job.get("first_host_only") and hosts:
        hosts = hosts[:1]
    gate = job.get("host_gate")
    if gate:
        hosts = [h for h in hosts if _truthy(hostvars.get(h, {}).get(gate, False))]
    return hosts


def scrape_targets(jobs: Sequence[Mapping[str, Any]], groups: Mapping[str, Sequence[str]],
                   hostvars: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Return {job name: static_configs target groups}, one group per host so each carries its own labels.

    Every target gets `node` (the inventory name) and `train_node` ("true" when the host is in train_nodes,
    which the training alerts select on). A job's `scheduled_var` names a host variable that, true, marks the
    target `scheduled="true"`: it answers only while a Slurm job runs it (ExporterDown leaves those out). Disabled
    jobs (`enabled: false`) are left out entirely.
    """
    train = set(groups.get("train_nodes", []))
    out: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        name = str(job["name"])
        if not _truthy(job.get("enabled", True)):
            continue
        if name in out:
            raise ValueError(f"prometheus_scrape_jobs: job {name!r} is defined twice")
        port = int(job["port"])
        scheduled = job.get("scheduled_var")
        out[name] = [
            {
                "targets": [f"{_address(h, hostvars)}:{port}"],
                "labels": {"node": h, "train_node": "true" if h in train else "false",
                           **({"scheduled": "true"} if scheduled and _truthy(hostvars.get(h, {}).get(scheduled))
                              else {})},
            }
            for h in _job_hosts(job, groups, hostvars)
        ]
    return out


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_scrape_targets": scrape_targets}
