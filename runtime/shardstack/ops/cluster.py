"""Day-2 helpers on a deployed cluster: inventory lookups, waiting for a job, export to the serving directory,
and a client for the inference endpoint through the load balancer. Everything goes through ansible-runner (or
plain HTTP to the load balancer), so it works the same on the lab and on a real cluster.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops import train as train_ops
from shardstack.ops.runner import existing_inventory, project_dir, run_command, tools_on_path


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


def setting(inv: dict[str, Any], name: str, role: str, group_name: str = "all") -> Any:
    """A variable as the roles see it on the group's first host: the inventory's value, else the role's default.
    Only plain values resolve here (no play runs): a default that is a template must be set in the inventory."""
    hosts = inv["groups"].get(group_name) or []
    hostvars = inv["hostvars"].get(hosts[0], {}) if hosts else {}
    value = hostvars[name] if name in hostvars else _role_default(role, name)
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


def wait_job(name: str, inventory: Path, timeout: float, *, poll: float = 5.0,
             on_status=None) -> train_ops.JobStatus:
    """Poll `train status` until the job has finished (or failed, or the timeout passed)."""
    deadline = time.monotonic() + timeout
    seen_running = False
    while True:
        st = train_ops.status(name, inventory)
        if on_status:
            on_status(st)
        seen_running |= st.state == "running"
        # A freshly started unit may not be active yet on every node: "finished" counts only after it ran.
        if st.state == "failed" or (st.state in ("finished", "stopped") and (seen_running or st.last_step)):
            return st
        if time.monotonic() > deadline:
            raise ShardstackError(f"job {name} still {st.state} after {timeout:.0f}s",
                                  hint=f"shardstack train logs {name}")
        time.sleep(poll)


@dataclass
class ClusterExport:
    host: str
    out_dir: str
    current: str
    output: str


def export_current(inventory: Path, checkpoint_dir: str, name: str) -> ClusterExport:
    """Export the newest valid checkpoint to <shared>/exports/<name> and point <shared>/exports/current at it.

    The switch is a symlink rename, so an inference node (re)starting at any moment sees either the old or the
    new model, never half of one.
    """
    inv = inventory_hosts(inventory)
    head = group(inv, "train_nodes")[0]
    venv = setting(inv, "training_runtime_venv", "training_runtime", "train_nodes")
    user = setting(inv, "shardstack_user", "shardstack_common", "train_nodes")
    models = f"{shared_dir(inv)}/exports"
    out = f"{models}/{name}"
    script = " && ".join(shlex.join(c) for c in (
        [f"{venv}/bin/shardstack", "export", "--checkpoint", checkpoint_dir, "--out", out],
        ["ln", "-sfn", "--no-target-directory", name, f"{models}/.current.tmp"],
        ["mv", "-T", f"{models}/.current.tmp", f"{models}/current"]))
    res = run_command(["runuser", "-u", user, "--", "sh", "-c", script], inventory, head)[head]
    if not res.success:
        raise ShardstackError(f"export on {head} failed: {(res.stderr or res.stdout or res.message or '')[-800:]}")
    return ClusterExport(head, out, f"{models}/current", (res.stdout + res.stderr).strip())


def load_token(inventory: Path) -> str | None:
    """The bearer token the inference nodes expect, found as the inference_service role finds it: the inventory's
    `inference_service_token`, else the file at `inference_service_token_store` (the inventory's value, else the
    role's default), where the role keeps the token it generated. None when there is none yet."""
    inv = inventory_hosts(inventory)
    nodes = inv["groups"].get("inference_nodes") or []
    hostvars = inv["hostvars"].get(nodes[0], {}) if nodes else {}
    if hostvars.get("inference_service_token"):
        return str(hostvars["inference_service_token"])
    store = str(hostvars.get("inference_service_token_store") or _role_default("inference_service",
                                                                                "inference_service_token_store"))
    inventory = inventory.resolve()
    store = store.replace("{{ inventory_dir }}", str(inventory if inventory.is_dir() else inventory.parent))
    if "{{" in store:
        raise ShardstackError(f"inference_service_token_store={store!r}: only {{{{ inventory_dir }}}} is resolved "
                              "outside a play; set a plain path")
    path = Path(store)
    return path.read_text().strip() if path.is_file() else None


def _role_default(role: str, name: str) -> Any:
    import yaml

    return yaml.safe_load((project_dir() / "roles" / role / "defaults" / "main.yml").read_text())[name]


def lb_url(inventory: Path) -> str:
    inv = inventory_hosts(inventory)
    port = setting(inv, "loadbalancer_port", "loadbalancer", "loadbalancer")
    return f"http://{address(inv, group(inv, 'loadbalancer')[0])}:{port}"


@dataclass
class Completion:
    status: int
    seconds: float
    text: str
    body: dict[str, Any]


def complete(url: str, prompt: str, *, token: str | None, max_tokens: int = 32, temperature: float = 0.0,
             timeout: float = 30.0) -> Completion:
    """POST /v1/completions (non-streaming) and time it."""
    payload = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{url}/v1/completions", data=payload, headers=headers, method="POST")
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return Completion(-1, time.monotonic() - t, "", {"error": str(exc)})
    seconds = time.monotonic() - t
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"raw": raw[:500].decode(errors="replace")}
    text = (body.get("choices") or [{}])[0].get("text", "") if status == 200 else ""
    return Completion(status, seconds, text, body)
