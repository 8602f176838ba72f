"""The cluster as its inventory describes it: hosts, groups, addresses and the settings the roles would use
(the inventory's value, else the role's default). What lies on its shared storage is ops/storage.py's; the inference
endpoint and its credentials, ops/endpoint.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.runner import existing_inventory, project_dir, tools_on_path


def inventory_hosts(inventory: Path) -> dict[str, Any]:
    """`ansible-inventory --list` through ansible-runner: {"groups": {name: [hosts]}, "hostvars": {...}}."""
    import ansible_runner

    inventory = existing_inventory(inventory)
    # ansible-runner looks ansible-inventory up on this process's PATH, which need not hold this venv's bin/.
    with tools_on_path():
        out, err = ansible_runner.get_inventory(action="list", inventories=[str(inventory)],
                                                response_format="json", quiet=True)
    if not isinstance(out, dict):
        raise ShardstackError(f"cannot read inventory {inventory}: {err or out}")
    hostvars = out.get("_meta", {}).get("hostvars", {})
    groups: dict[str, list[str]] = {}

    def hosts_of(group: str) -> list[str]:
        node = out.get(group, {})
        found = list(node.get("hosts", []))
        for child in node.get("children", []):
            found += [h for h in hosts_of(child) if h not in found]
        return found

    for group in out:
        if group != "_meta":
            groups[group] = hosts_of(group)
    return {"groups": groups, "hostvars": hostvars}


REQUIRED_GROUPS = ("train_nodes", "inference_nodes", "loadbalancer")


def check_inventory(inventory: Path) -> list[str]:
    """Problems with the inventory's shape (empty = fine); the reachability check is the preflight playbook's."""
    inv = inventory_hosts(inventory)
    problems = [f"group {g} has no hosts" for g in REQUIRED_GROUPS if not inv["groups"].get(g)]
    if len(inv["groups"].get("loadbalancer", [])) > 1:
        problems.append("more than one loadbalancer host: rollouts drain each, but clients need one address")
    return problems


def first_hostvars(inv: dict[str, Any], group_name: str) -> dict[str, Any]:
    hosts = inv["groups"].get(group_name) or []
    return inv["hostvars"].get(hosts[0], {}) if hosts else {}


def inventory_vars(inv: dict[str, Any], group_name: str = "all") -> dict[str, Any]:
    """The inventory's own variables of the group's first host (no role defaults)."""
    return dict(first_hostvars(inv, group_name))


def setting(inv: dict[str, Any], name: str, role: str, group_name: str = "all") -> Any:
    """A variable as the roles see it on the group's first host: the inventory's value, else the role's default.
    Only plain values resolve here (no play runs): a default that is a template must be set in the inventory."""
    hostvars = first_hostvars(inv, group_name)
    value = hostvars[name] if name in hostvars else role_default(role, name)
    if isinstance(value, str) and "{{" in value:
        raise ShardstackError(f"{name}={value!r} is a template; only plain values resolve outside a play",
                              hint=f"set {name} in the inventory's group_vars")
    return value


def shared_dir(inv: dict[str, Any]) -> str:
    """The shared storage every node mounts (shardstack_shared_dir): data/, checkpoints/ and exports/ below it."""
    return str(setting(inv, "shardstack_shared_dir", "shardstack_common"))


def address(inv: dict[str, Any], host: str) -> str:
    return inv["hostvars"].get(host, {}).get("ansible_host", host)


def group(inv: dict[str, Any], name: str) -> list[str]:
    hosts = inv["groups"].get(name, [])
    if not hosts:
        raise ShardstackError(f"the inventory has no hosts in group {name}")
    return hosts


def job_account(inv: dict[str, Any]) -> str:
    """The account jobs run as on the train nodes (training_runtime_user, whose default is shardstack_user): it owns
    <shared>/data, checkpoints/ and exports/, and it alone can read the signing key."""
    if "training_runtime_user" in first_hostvars(inv, "train_nodes"):
        return str(setting(inv, "training_runtime_user", "training_runtime", "train_nodes"))
    return str(setting(inv, "shardstack_user", "shardstack_common", "train_nodes"))


def controller_path(inventory: Path, name: str, value: str) -> Path:
    """A path on the controller as a play resolves it; here only `{{ inventory_dir }}` can be resolved."""
    inventory = inventory.resolve()
    value = value.replace("{{ inventory_dir }}", str(inventory if inventory.is_dir() else inventory.parent))
    if "{{" in value:
        raise ShardstackError(f"{name}={value!r}: only {{{{ inventory_dir }}}} is resolved outside a play; set a "
                              "plain path")
    return Path(value)


def role_default(role: str, name: str) -> Any:
    import yaml

    return yaml.safe_load((project_dir() / "roles" / role / "defaults" / "main.yml").read_text())[name]
