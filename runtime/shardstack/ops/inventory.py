"""The cluster as its inventory describes it: hosts, groups, addresses and the settings the roles would use (the
inventory's value, else the role's default), read once per command. What lies on its shared storage is
ops/storage.py's; the inference endpoint and its credentials, ops/endpoint.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.jobs.common import TRAIN_GROUP
from shardstack.ops.roles import role_default
from shardstack.ops.runner import existing_inventory, tools_on_path

REQUIRED_GROUPS = ("train_nodes", "inference_nodes", "loadbalancer")

Groups = dict[str, list[str]]
HostVars = dict[str, dict[str, Any]]


def read_inventory(inventory: Path) -> tuple[Groups, HostVars]:
    """`ansible-inventory --list` through ansible-runner → (groups with their children's hosts, hostvars). The one
    place the inventory is read; a Cluster calls it at most once."""
    import ansible_runner

    inventory = existing_inventory(inventory)
    # ansible-runner looks ansible-inventory up on this process's PATH, which need not hold this venv's bin/.
    with tools_on_path():
        out, err = ansible_runner.get_inventory(action="list", inventories=[str(inventory)],
                                                response_format="json", quiet=True)
    if not isinstance(out, dict):
        raise ShardstackError(f"cannot read inventory {inventory}: {err or out}")

    def hosts_of(group: str) -> list[str]:
        node = out.get(group, {})
        found = list(node.get("hosts", []))
        for child in node.get("children", []):
            found += [h for h in hosts_of(child) if h not in found]
        return found

    return {g: hosts_of(g) for g in out if g != "_meta"}, out.get("_meta", {}).get("hostvars", {})


class Cluster:
    """One inventory: its `path` (what ansible-runner's playbook and ad-hoc runs are given) and its listing, read
    when first asked for and kept for the rest of the command, so a waiting loop or a verb that asks ten questions
    costs one `ansible-inventory` run. A command that only runs playbooks never reads it at all."""

    def __init__(self, path: Path, groups: Groups | None = None, hostvars: HostVars | None = None) -> None:
        self.path = Path(path)
        self._listing = None if groups is None else (groups, hostvars or {})

    @classmethod
    def load(cls, path: Path) -> Cluster:
        """The cluster of the inventory at `path` (a file or a directory); read on first use."""
        return cls(path)

    def __repr__(self) -> str:
        return f"Cluster({str(self.path)!r})"

    def _read(self) -> tuple[Groups, HostVars]:
        if self._listing is None:
            self._listing = read_inventory(self.path)
        return self._listing

    @property
    def groups(self) -> Groups:
        """Group → its hosts, a child group's included."""
        return self._read()[0]

    @property
    def hostvars(self) -> HostVars:
        return self._read()[1]

    def hosts(self, name: str) -> list[str]:
        """The group's hosts; none when the inventory has no such group."""
        return self.groups.get(name, [])

    def group(self, name: str) -> list[str]:
        """The group's hosts; an error when it has none."""
        hosts = self.hosts(name)
        if not hosts:
            raise ShardstackError(f"the inventory has no hosts in group {name}")
        return hosts

    def first_hostvars(self, group_name: str) -> dict[str, Any]:
        """The inventory's own variables of the group's first host (no role defaults)."""
        hosts = self.hosts(group_name)
        return self.hostvars.get(hosts[0], {}) if hosts else {}

    def address(self, host: str) -> str:
        return self.hostvars.get(host, {}).get("ansible_host", host)

    def setting(self, name: str, role: str, group_name: str = "all") -> Any:
        """A variable as the roles see it on the group's first host: the inventory's value, else the role's default.
        Only plain values resolve here (no play runs): a default that is a template must be set in the inventory."""
        hosts = self.hosts(group_name)
        return self.host_setting(name, role, hosts[0] if hosts else None)

    def host_setting(self, name: str, role: str, host: str | None) -> Any:
        """A variable as the roles see it on this host (None: on none): the inventory's value, else the role's
        default; plain values only, as for `setting`."""
        hostvars = self.hostvars.get(host, {}) if host else {}
        value = hostvars[name] if name in hostvars else role_default(role, name)
        if isinstance(value, str) and "{{" in value:
            raise ShardstackError(f"{name}={value!r} is a template; only plain values resolve outside a play",
                                  hint=f"set {name} in the inventory's group_vars")
        return value

    @property
    def shared_dir(self) -> str:
        """The shared storage every node mounts (shardstack_shared_dir): data/, checkpoints/ and exports/ below it."""
        return str(self.setting("shardstack_shared_dir", "shardstack_common"))

    @property
    def job_account(self) -> str:
        """The account jobs run as on the train nodes (training_runtime_user, whose default is shardstack_user): it
        owns <shared>/data, checkpoints/ and exports/, and it alone can read the signing key."""
        if "training_runtime_user" in self.first_hostvars(TRAIN_GROUP):
            return str(self.setting("training_runtime_user", "training_runtime", TRAIN_GROUP))
        return str(self.setting("shardstack_user", "shardstack_common", TRAIN_GROUP))

    @property
    def scheduler(self) -> str:
        """Who runs training jobs on this cluster: the inventory's shardstack_scheduler (systemd or slurm)."""
        value = self.setting("shardstack_scheduler", "shardstack_common", TRAIN_GROUP)
        if value not in ("systemd", "slurm"):
            raise ShardstackError(f"shardstack_scheduler is {value!r}", hint="set systemd or slurm in group_vars")
        return str(value)

    def controller_path(self, name: str, value: str) -> Path:
        """A path on the controller as a play resolves it; here only `{{ inventory_dir }}` can be resolved."""
        inventory = self.path.resolve()
        value = value.replace("{{ inventory_dir }}", str(inventory if inventory.is_dir() else inventory.parent))
        if "{{" in value:
            raise ShardstackError(f"{name}={value!r}: only {{{{ inventory_dir }}}} is resolved outside a play; set a "
                                  "plain path")
        return Path(value)

    def problems(self) -> list[str]:
        """Problems with the inventory's shape (empty = fine); the reachability check is the preflight playbook's."""
        problems = [f"group {g} has no hosts" for g in REQUIRED_GROUPS if not self.hosts(g)]
        if len(self.hosts("loadbalancer")) > 1:
            problems.append("more than one loadbalancer host: rollouts drain each, but clients need one address")
        return problems
