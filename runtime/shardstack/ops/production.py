"""The production variables (shardstack.build.variables.PRODUCTION) an inventory leaves to the role default.

`shardstack check` prints one warning per variable: the hosts of its group where the inventory (group_vars,
host_vars, the hosts file) does not set it. Set, even to the default, counts as decided: only absence warns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardstack.build.variables import PRODUCTION, ProductionVar, load_roles, spec_defaults
from shardstack.ops.inventory import Cluster

MAX_HOSTS_SHOWN = 5


@dataclass(frozen=True)
class UnsetVariable:
    name: str
    role: str
    group: str
    hosts: list[str]  # the hosts of `group` that leave it unset
    of_hosts: int  # how many hosts the group has
    reason: str

    def message(self) -> str:
        shown = ", ".join(self.hosts[:MAX_HOSTS_SHOWN])
        if len(self.hosts) > MAX_HOSTS_SHOWN:
            shown += f" and {len(self.hosts) - MAX_HOSTS_SHOWN} more"
        where = f"group {self.group} ({shown})" if len(self.hosts) == self.of_hosts else \
            f"{len(self.hosts)} of the {self.of_hosts} hosts of group {self.group} ({shown})"
        return f"{self.name} ({self.role}) is unset on {where}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "message": self.message()}


def _applies(var: ProductionVar, hostvars: dict[str, Any], defaults: dict[str, Any]) -> bool:
    if var.only_if is None:
        return True
    name, values = var.only_if
    # YAML gives `false` as a bool and `"false"` as a string; both read the same here.
    return str(hostvars.get(name, defaults.get(name))).lower() in values


def unset_in(cluster: Cluster, defaults: dict[str, Any]) -> list[UnsetVariable]:
    """The production variables unset on some host of their group, from the inventory as Ansible reads it and the
    roles' defaults (which decide the `only_if` conditions the inventory leaves alone)."""
    found = []
    for var in PRODUCTION:
        group = cluster.hosts(var.group)
        unset = sorted(h for h in group if _applies(var, cluster.hostvars.get(h, {}), defaults)
                       and var.name not in cluster.hostvars.get(h, {}))
        if unset:
            found.append(UnsetVariable(var.name, var.role, var.group, unset, len(group), var.reason))
    return found


def unset_production_variables(cluster: Cluster, roles: Path | None = None) -> list[UnsetVariable]:
    """The production variables the inventory leaves unset."""
    return unset_in(cluster, spec_defaults(load_roles(roles)))


def warning_lines(unset: list[UnsetVariable]) -> list[str]:
    """What `shardstack check` prints after its report, one line per variable (empty when nothing is unset)."""
    if not unset:
        return []
    return [f"production: {u.message()}" for u in unset] + [
        "production: set these in the inventory's group_vars (docs/variables.md, \"What production must set\")"]
