"""Day-2 helpers on a deployed cluster: inventory lookups, waiting for a job, export to the serving directory,
and a client for the inference endpoint through the load balancer. Everything goes through ansible-runner (or
HTTPS to the load balancer, trusting the cluster CA), so it works the same on the lab and on a real cluster.
"""

from __future__ import annotations

import functools
import json
import shlex
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.runner import existing_inventory, project_dir, run_command, run_module, tools_on_path


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


def _first_hostvars(inv: dict[str, Any], group_name: str) -> dict[str, Any]:
    hosts = inv["groups"].get(group_name) or []
    return inv["hostvars"].get(hosts[0], {}) if hosts else {}


def setting(inv: dict[str, Any], name: str, role: str, group_name: str = "all") -> Any:
    """A variable as the roles see it on the group's first host: the inventory's value, else the role's default.
    Only plain values resolve here (no play runs): a default that is a template must be set in the inventory."""
    hostvars = _first_hostvars(inv, group_name)
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


def _controller_path(inventory: Path, name: str, value: str) -> Path:
    """A path on the controller as a play resolves it; here only `{{ inventory_dir }}` can be resolved."""
    inventory = inventory.resolve()
    value = value.replace("{{ inventory_dir }}", str(inventory if inventory.is_dir() else inventory.parent))
    if "{{" in value:
        raise ShardstackError(f"{name}={value!r}: only {{{{ inventory_dir }}}} is resolved outside a play; set a "
                              "plain path")
    return Path(value)


def _token(inv: dict[str, Any], inventory: Path) -> str | None:
    hostvars = _first_hostvars(inv, "inference_nodes")
    if hostvars.get("inference_service_token"):
        return str(hostvars["inference_service_token"])
    name = "inference_service_token_store"
    path = _controller_path(inventory, name, str(hostvars.get(name) or _role_default("inference_service", name)))
    return path.read_text().strip() if path.is_file() else None


def place_model(inventory: Path, local_dir: Path, *, become: bool = True) -> str:
    """Copy a model directory of this machine (e.g. the cached pretrained model) to <shared>/pretrained/<its name>
    through the first train node, where every node sees it; returns that path. Unchanged files are not copied again
    (the copy module compares checksums)."""
    inv = inventory_hosts(inventory)
    head = group(inv, "train_nodes")[0]
    dest = f"{shared_dir(inv)}/pretrained/{local_dir.name}"
    args = {"src": f"{local_dir}/", "dest": f"{dest}/", "mode": "u=rwX,go=rX", "directory_mode": "0755"}
    res = run_module("ansible.builtin.copy", args, inventory, head, become=become)
    if head not in res or not res[head].success:
        msg = res[head].message if head in res else "no result"
        raise ShardstackError(f"copying {local_dir} to {head}:{dest} failed: {msg}",
                              hint="is the shared storage mounted? shardstack validate")
    return dest


def load_token(inventory: Path) -> str | None:
    """The bearer token the inference nodes expect, found as the inference_service role finds it: the inventory's
    `inference_service_token`, else the file at `inference_service_token_store` (the inventory's value, else the
    role's default), where the role keeps the token it generated. None when there is none yet."""
    return _token(inventory_hosts(inventory), inventory)


# The cluster CA's certificate in loadbalancer_tls_store (the loadbalancer role's vars/main.yml names it too).
CLUSTER_CA = "cluster-ca.crt.txt"


def _ca(inv: dict[str, Any], inventory: Path) -> Path | None:
    hostvars = _first_hostvars(inv, "loadbalancer")
    if hostvars.get("loadbalancer_tls_ca"):
        return _controller_path(inventory, "loadbalancer_tls_ca", str(hostvars["loadbalancer_tls_ca"]))
    if hostvars.get("loadbalancer_tls_cert"):
        return None  # the inventory's own certificate and no CA named for it: a publicly trusted one
    name = "loadbalancer_tls_store"
    store = _controller_path(inventory, name, str(hostvars.get(name) or _role_default("loadbalancer", name)))
    return store / CLUSTER_CA


def load_ca(inventory: Path) -> Path | None:
    """The CA certificate clients verify the load balancer with, found as the loadbalancer role finds it: the
    inventory's `loadbalancer_tls_ca`, else the cluster CA in `loadbalancer_tls_store` when the role issues the
    certificate; None (the system's trust store) for a certificate of the inventory's own without a CA named."""
    return _ca(inventory_hosts(inventory), inventory)


def _role_default(role: str, name: str) -> Any:
    import yaml

    return yaml.safe_load((project_dir() / "roles" / role / "defaults" / "main.yml").read_text())[name]


@dataclass(frozen=True)
class Endpoint:
    """The inference API as clients reach it: through the load balancer, over HTTPS, with the bearer token."""

    url: str
    token: str | None
    cafile: Path | None  # the CA to trust; None = the system's trust store

    @functools.cached_property
    def tls(self) -> ssl.SSLContext:
        if self.cafile is not None and not self.cafile.is_file():
            raise ShardstackError(f"no CA certificate at {self.cafile}",
                                  hint="the loadbalancer role creates the cluster CA there: deploy it first")
        return ssl.create_default_context(cafile=str(self.cafile) if self.cafile else None)

    def call(self, method: str, path: str, payload: dict[str, Any] | None = None, *,
             timeout: float = 30.0) -> tuple[int, bytes]:
        """One request → (status, body); an HTTP error status is an answer too. A refused or broken connection
        raises OSError; a certificate the client does not accept raises ShardstackError (one line and a hint)."""
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                raise self._tls_error(exc.reason) from None
            raise
        except ssl.SSLError as exc:
            raise self._tls_error(exc) from None

    def _tls_error(self, err: ssl.SSLError) -> ShardstackError:
        trust = f"the CA in {self.cafile}" if self.cafile else "the system's trust store"
        if isinstance(err, ssl.SSLCertVerificationError):
            why = err.verify_message or err.reason or str(err)
            hint = ("add the name you connect to to loadbalancer_tls_names and deploy again" if "mismatch" in why
                    else "set loadbalancer_tls_ca to the CA that signed the load balancer's certificate, or deploy "
                         "again so the load balancer serves the cluster CA's")
            return ShardstackError(f"TLS: {self.url} presented a certificate {trust} does not accept: {why}",
                                   hint=hint)
        return ShardstackError(f"TLS: handshake with {self.url} failed: {err.reason or err}")


def endpoint(inventory: Path) -> Endpoint:
    """The load balancer's https URL (its inventory address, which the issued certificate names), the token and the
    CA certificate, from one read of the inventory."""
    inv = inventory_hosts(inventory)
    port = int(setting(inv, "loadbalancer_tls_port", "loadbalancer", "loadbalancer"))
    host = address(inv, group(inv, "loadbalancer")[0])
    host = f"[{host}]" if ":" in host else host
    url = f"https://{host}" if port == 443 else f"https://{host}:{port}"
    return Endpoint(url, _token(inv, inventory), _ca(inv, inventory))


@dataclass
class Completion:
    status: int
    seconds: float
    text: str
    body: dict[str, Any]


def complete(ep: Endpoint, prompt: str, *, max_tokens: int = 32, temperature: float = 0.0,
             timeout: float = 30.0) -> Completion:
    """POST /v1/completions (non-streaming) and time it; status -1 when the connection failed."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    t = time.monotonic()
    try:
        status, raw = ep.call("POST", "/v1/completions", payload, timeout=timeout)
    except OSError as exc:
        return Completion(-1, time.monotonic() - t, "", {"error": str(exc)})
    seconds = time.monotonic() - t
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"raw": raw[:500].decode(errors="replace")}
    text = (body.get("choices") or [{}])[0].get("text", "") if status == 200 else ""
    return Completion(status, seconds, text, body)
