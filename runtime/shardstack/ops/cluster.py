"""Day-2 helpers on a deployed cluster: inventory lookups, waiting for a job, export to the serving directory,
and a client for the inference endpoint through the load balancer. Everything goes through ansible-runner (or
HTTPS to the load balancer, trusting the cluster CA), so it works the same on the lab and on a real cluster.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
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


def inventory_vars(inv: dict[str, Any], group_name: str = "all") -> dict[str, Any]:
    """The inventory's own variables of the group's first host (no role defaults)."""
    return dict(_first_hostvars(inv, group_name))


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


def job_account(inv: dict[str, Any]) -> str:
    """The account jobs run as on the train nodes (training_runtime_user, whose default is shardstack_user): it owns
    <shared>/data, checkpoints/ and exports/, and it alone can read the signing key."""
    if "training_runtime_user" in _first_hostvars(inv, "train_nodes"):
        return str(setting(inv, "training_runtime_user", "training_runtime", "train_nodes"))
    return str(setting(inv, "shardstack_user", "shardstack_common", "train_nodes"))


@dataclass
class ClusterExport:
    host: str
    out_dir: str
    current: str
    output: str
    step: int | None = None  # the step exported, as `shardstack export` reported it
    signed: bool = True  # the export's manifest is signed with the node's key (False: --allow-unsigned)


def export_argv(venv: str, checkpoint: str, out: str, *, key_file: str | None = None,
                allow_unsigned: bool = False) -> list[str]:
    """`shardstack export` as the node runs it: with the node's signing key (the default one, or the job's
    checkpoint.signing_key_file), or --allow-unsigned for a job that signs nothing."""
    argv = [f"{venv}/bin/shardstack", "export", "--checkpoint", checkpoint, "--out", out]
    if allow_unsigned:
        argv.append("--allow-unsigned")
    elif key_file:
        argv += ["--key-file", key_file]
    return argv


def export_current(inventory: Path, checkpoint_dir: str, name: str, *, key_file: str | None = None,
                   allow_unsigned: bool = False) -> ClusterExport:
    """Export a checkpoint (a step directory, or a checkpoint root: its newest valid checkpoint) to
    <shared>/exports/<name> on the first train node, as the job account with the node's signing key, and point
    <shared>/exports/current at it.

    The switch is a symlink rename, so an inference node (re)starting at any moment sees either the old or the
    new model, never half of one.
    """
    inv = inventory_hosts(inventory)
    head = group(inv, "train_nodes")[0]
    venv = setting(inv, "training_runtime_venv", "training_runtime", "train_nodes")
    models = f"{shared_dir(inv)}/exports"
    out = f"{models}/{name}"
    script = " && ".join(shlex.join(c) for c in (
        export_argv(venv, checkpoint_dir, out, key_file=key_file, allow_unsigned=allow_unsigned),
        ["ln", "-sfn", "--no-target-directory", name, f"{models}/.current.tmp"],
        ["mv", "-T", f"{models}/.current.tmp", f"{models}/current"]))
    res = run_command(["runuser", "-u", job_account(inv), "--", "sh", "-c", script], inventory, head)[head]
    if not res.success:
        raise ShardstackError(f"export on {head} failed: {(res.stderr or res.stdout or res.message or '')[-800:]}")
    output = (res.stdout + res.stderr).strip()
    step = re.search(r"exported step (\d+)", output)
    return ClusterExport(head, out, f"{models}/current", output, int(step[1]) if step else None,
                         not allow_unsigned)


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


NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str, what: str = "name") -> str:
    """A directory name under <shared>/pretrained or <shared>/data: one path component, nothing hidden."""
    if not NAME.match(name):
        raise ShardstackError(f"{what} {name!r} is not valid", hint="use [A-Za-z0-9._-], starting with a letter or "
                              "digit, up to 128 characters")
    return name


def _copy(inventory: Path, inv: dict[str, Any], src: Path, dest: str, *, become: bool) -> str:
    """Copy a file or directory of this machine into the directory `dest` on the first train node (shared storage,
    so every node sees it), as the job account (`become`): it owns what jobs read and write there, and root would be
    squashed to nobody on the NFS export (root_squash). The copy module compares checksums: unchanged files are not
    sent again."""
    head = group(inv, "train_nodes")[0]
    args = {"src": f"{src}/" if src.is_dir() else str(src), "dest": f"{dest}/", "mode": "u=rwX,go=rX",
            "directory_mode": "0755"}
    res = run_module("ansible.builtin.copy", args, inventory, head, become=become,
                     become_user=job_account(inv) if become else None)
    if head not in res or not res[head].success:
        msg = res[head].message if head in res else "no result"
        raise ShardstackError(f"copying {src} to {head}:{dest} failed: {msg}",
                              hint="is the shared storage mounted? shardstack validate")
    return head


def place_model(inventory: Path, local_dir: Path, *, name: str | None = None, become: bool = True) -> str:
    """Copy a model directory of this machine (e.g. the cached pretrained model) to <shared>/pretrained/<name> (its
    own name by default) through the first train node, where every node sees it; returns that path. Unchanged files
    are not copied again (the copy module compares checksums)."""
    inv = inventory_hosts(inventory)
    dest = f"{shared_dir(inv)}/pretrained/{check_name(name or local_dir.name, 'model name')}"
    _copy(inventory, inv, local_dir, dest, become=become)
    return dest


def local_checksums(src: Path) -> dict[str, str]:
    """sha256 of every file under a directory (or of one file), by its path relative to what the copy writes."""
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    return {(p.relative_to(src).as_posix() if src.is_dir() else p.name): _sha256(p) for p in files}


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_argv(dest: str) -> list[str]:
    """sha256 of every file under `dest` on a node, one `HASH  ./relative/path` line each (sha256sum's format)."""
    return ["sh", "-c", 'cd "$1" && find . -type f -print0 | sort -z | xargs -0r sha256sum', "sh", dest]


def parse_checksums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if sep and re.fullmatch(r"[0-9a-f]{64}", digest):
            out[name.removeprefix("./")] = digest
    return out


@dataclass
class Verified:
    """A copy on shared storage checked file by file against the source here."""

    path: str
    files: int
    bytes: int
    extra: list[str]  # files on the node the source does not have (left by an earlier copy; not an error)


def compare_checksums(local: dict[str, str], remote: dict[str, str], where: str) -> list[str]:
    """Extra files on the node are not the copy's business; returns them. A file missing there or different is an
    error naming it (all of them, sorted)."""
    missing = sorted(set(local) - set(remote))
    differ = sorted(n for n in set(local) & set(remote) if local[n] != remote[n])
    if missing or differ:
        parts = ([f"missing on the node: {', '.join(missing)}"] if missing else []) + (
            [f"sha256 differs: {', '.join(differ)}"] if differ else [])
        raise ShardstackError(f"{where} does not match the source: {'; '.join(parts)}",
                              hint="put it again; if it still differs, check the shared storage (shardstack validate)")
    return sorted(set(remote) - set(local))


def verify_copy(inventory: Path, head: str, src: Path, dest: str) -> Verified:
    """sha256 of every file of `src` here against the copy at `dest` on `head`, in one command on the node."""
    local = local_checksums(src)
    res = run_command(checksum_argv(dest), inventory, head)
    if head not in res or not res[head].success:
        r = res.get(head)
        raise ShardstackError(f"cannot read the checksums of {head}:{dest}: "
                              f"{(r.stderr or r.message or '') if r else 'no result'}".strip())
    extra = compare_checksums(local, parse_checksums(res[head].stdout), f"{head}:{dest}")
    size = sum(p.stat().st_size for p in ([src] if src.is_file() else src.rglob("*")) if p.is_file())
    return Verified(dest, len(local), size, extra)


def put_model(inventory: Path, local_dir: Path, name: str | None = None) -> Verified:
    """`shardstack model put`: a Hugging Face model directory here → <shared>/pretrained/<name>, verified."""
    if not (local_dir / "config.json").is_file():
        raise ShardstackError(f"{local_dir} is not a model directory (no config.json)",
                              hint="pass a Hugging Face model directory (config.json, weights, tokenizer)")
    inv = inventory_hosts(inventory)
    dest = f"{shared_dir(inv)}/pretrained/{check_name(name or local_dir.resolve().name, 'model name')}"
    head = _copy(inventory, inv, local_dir, dest, become=True)
    return verify_copy(inventory, head, local_dir, dest)


def put_data(inventory: Path, src: Path, name: str | None = None) -> Verified:
    """`shardstack data put`: a corpus (a text file, a directory of them) or prepared token shards here →
    <shared>/data/<name>, verified."""
    if not src.exists():
        raise ShardstackError(f"{src} does not exist")
    if src.is_dir() and not any(p.is_file() for p in src.rglob("*")):
        raise ShardstackError(f"{src} holds no files")
    inv = inventory_hosts(inventory)
    default = src.resolve().name if src.is_dir() else src.stem
    dest = f"{shared_dir(inv)}/data/{check_name(name or default, 'data name')}"
    head = _copy(inventory, inv, src, dest, become=True)
    return verify_copy(inventory, head, src, dest)


def on_shared(path: str, shared: str) -> bool:
    """Whether an absolute path lies under the shared directory (`..` resolved, no prefix tricks: /srv/x-y is not
    under /srv/x)."""
    import posixpath

    if not path.startswith("/"):
        return False
    norm, root = posixpath.normpath(path), posixpath.normpath(shared)
    return norm != root and posixpath.commonpath([norm, root]) == root


def prepare_argv(venv: str, user: str, source: str, out: str, *, tokenizer: str = "bytes",
                 workers: int | None = None) -> list[str]:
    """`shardstack data prepare` on a node, as the job account (which owns <shared>/data)."""
    argv = ["runuser", "-u", user, "--", f"{venv}/bin/shardstack", "data", "prepare", source, "--out", out,
            "--tokenizer", tokenizer, "--json"]
    return argv + (["--workers", str(workers)] if workers else [])


@dataclass
class ClusterPrepare:
    host: str
    source: str  # the input on shared storage
    out: str
    meta: dict[str, Any]  # meta.json's fields, as `data prepare --json` printed them
    copied: Verified | None = None  # the local input, put on shared storage first


def prepare_on_cluster(inventory: Path, source: str, out_name: str, *, tokenizer: str = "bytes",
                       workers: int | None = None) -> ClusterPrepare:
    """`shardstack data prepare --cluster`: tokenise a corpus into <shared>/data/<out_name> on the first train node.
    The input is a path under the shared directory, or a file or directory here, put first to
    <shared>/data/<out_name>-text (verified). The tokenizer is `bytes` or a directory the node sees."""
    check_name(out_name, "--out-name")
    inv = inventory_hosts(inventory)
    shared = shared_dir(inv)
    if tokenizer != "bytes" and not on_shared(tokenizer, shared):
        raise ShardstackError(f"--tokenizer {tokenizer} is not under the shared directory {shared}",
                              hint="put the model first (shardstack model put DIR) and pass its path on the "
                                   "cluster, or bytes")
    copied = None
    if on_shared(source, shared):
        where = source
    elif Path(source).exists():
        copied = put_data(inventory, Path(source), f"{out_name}-text")
        where = copied.path if Path(source).is_dir() else f"{copied.path}/{Path(source).name}"
    else:
        raise ShardstackError(f"input {source} is neither a file here nor a path under the shared directory {shared}")
    head = group(inv, "train_nodes")[0]
    venv = str(setting(inv, "training_runtime_venv", "training_runtime", "train_nodes"))
    out = f"{shared}/data/{out_name}"
    argv = prepare_argv(venv, job_account(inv), where, out, tokenizer=tokenizer, workers=workers)
    res = run_command(argv, inventory, head)
    r = res.get(head)
    if r is None or not r.success:
        detail = ((r.stderr or r.stdout or r.message or "") if r else "no result").strip().splitlines()
        raise ShardstackError(f"data prepare on {head} failed: {detail[-1] if detail else 'rc ' + str(r.rc)}")
    try:
        meta = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError:
        raise ShardstackError(f"data prepare on {head} printed no result: {r.stdout[-300:]}") from None
    return ClusterPrepare(head, where, out, meta, copied)


def load_token(inventory: Path) -> str | None:
    """The bearer token the inference nodes expect, found as the inference_service role finds it: the inventory's
    `inference_service_token`, else the file at `inference_service_token_store` (the inventory's value, else the
    role's default), where the role keeps the token it generated. None when there is none yet."""
    return _token(inventory_hosts(inventory), inventory)


# The cluster CA's certificate in loadbalancer_tls_store (the loadbalancer role's vars/main.yml names it too).
CLUSTER_CA = "cluster-ca.crt.txt"


def _cluster_ca(inv: dict[str, Any], inventory: Path) -> Path:
    hostvars = _first_hostvars(inv, "loadbalancer")
    name = "loadbalancer_tls_store"
    store = _controller_path(inventory, name, str(hostvars.get(name) or _role_default("loadbalancer", name)))
    return store / CLUSTER_CA


def _ca(inv: dict[str, Any], inventory: Path) -> Path | None:
    hostvars = _first_hostvars(inv, "loadbalancer")
    if hostvars.get("loadbalancer_tls_ca"):
        return _controller_path(inventory, "loadbalancer_tls_ca", str(hostvars["loadbalancer_tls_ca"]))
    if hostvars.get("loadbalancer_tls_cert"):
        return None  # the inventory's own certificate and no CA named for it: a publicly trusted one
    return _cluster_ca(inv, inventory)


def load_cluster_ca(inventory: Path) -> Path:
    """The cluster CA's certificate on the controller (in `loadbalancer_tls_store`): what the inference backends'
    certificates, and the load balancer's unless the inventory brings its own, are verified with."""
    return _cluster_ca(inventory_hosts(inventory), inventory)


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
