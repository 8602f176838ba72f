"""Run the project's playbooks through ansible-runner and return typed results.

This is the Python API the CLI is built on: `run_playbook("site.yml", inventory)` → `RunResult` with per-host
ok/changed/failed counts and, for each failed host, the task and message that failed.

No value passed through here is ever a template (docs/design.md, "Security conventions"): extra variables and
module arguments reach Ansible marked unsafe (`inert`), so names, paths, grep patterns and job configs arrive
literally however many `{{`, `{%` or `{#` they hold; the one string Ansible would render that cannot be marked, an
ad-hoc host pattern, is refused if it holds a template marker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError


def project_dir() -> Path:
    """The directory holding site.yml: $SHARDSTACK_HOME, the current directory or a parent, the source tree of an
    editable install, else the copy a wheel carries (shardstack/_ansible, see setup.py)."""
    if env := os.environ.get("SHARDSTACK_HOME"):
        return Path(env).resolve()
    for d in (Path.cwd(), *Path.cwd().parents):
        if (d / "site.yml").is_file() and (d / "roles").is_dir():
            return d
    here = Path(__file__).resolve()
    for d in (here.parents[3], here.parents[1] / "_ansible"):
        if (d / "site.yml").is_file():
            return d
    raise ShardstackError("cannot find the shardstack project (site.yml)",
                          hint="run from the project directory or set SHARDSTACK_HOME")


def _is_checkout(root: Path) -> bool:
    return (root / "pyproject.toml").is_file()


def state_dir() -> Path:
    """Where runs write (ansible-runner's artifacts, the fact cache): `artifacts/` of a checkout; for the copy a
    wheel carries, which lives in site-packages, $SHARDSTACK_STATE_DIR or ~/.local/state/shardstack."""
    root = project_dir()
    if _is_checkout(root):
        return root / "artifacts"
    if env := os.environ.get("SHARDSTACK_STATE_DIR"):
        return Path(env).resolve()
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "shardstack"


def inventory_state_file(inventory: Path, kind: str) -> Path:
    """This inventory's `kind` state (cordon, autoscale) under the state directory: a readable name (the inventory's
    last path parts) and a hash of its resolved path, so two inventories never share a file and one always finds its
    own."""
    inventory = inventory.resolve()
    digest = hashlib.sha256(str(inventory).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(inventory.parts[-2:])).strip("._-") or "inventory"
    return state_dir() / kind / f"{name}-{digest}.json"


@dataclass
class HostResult:
    host: str
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    failed_task: str | None = None
    message: str | None = None

    @property
    def success(self) -> bool:
        return not (self.failed or self.unreachable)


@dataclass
class RunResult:
    playbook: str
    status: str  # ansible-runner's: successful | failed | timeout | canceled
    rc: int
    seconds: float
    artifact_dir: str
    hosts: dict[str, HostResult] = field(default_factory=dict)
    # What the playbook published with ansible.builtin.set_stats (e.g. validate.yml's measurements).
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.rc == 0 and all(h.success for h in self.hosts.values())

    @property
    def changed(self) -> int:
        return sum(h.changed for h in self.hosts.values())

    @property
    def failed(self) -> int:
        return sum(h.failed + h.unreachable for h in self.hosts.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(success=self.success, changed=self.changed, failed=self.failed)
        return d


RunnerEvent = dict[str, Any]  # one ansible-runner event, as its event_handler receives it


KEEP_RUNS = 20  # run directories kept under each parent (artifacts/runs, artifacts/adhoc)
_RUN_DIR = re.compile(r"\d{8}-\d{6}-[0-9a-f]{8}")


def _private_dir(parent: Path, keep: int = KEEP_RUNS) -> Path:
    """A fresh ansible-runner private_data_dir per run: runner reads env/extravars back from it, so a shared one
    would hand one run's extra variables to the next run that passes none. The oldest run directories beyond
    `keep` are removed (names sort by time), so artifacts do not grow without bound; nothing else is touched."""
    parent = parent.resolve()
    path = parent / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    runs = sorted(p for p in parent.iterdir() if p.is_dir() and _RUN_DIR.fullmatch(p.name))
    for old in runs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


# What makes Jinja act on a string: expressions, statements, comments.
TEMPLATE_MARKERS = ("{{", "{%", "{#")
# ansible-core's JSON form of an unsafe string: its JSON decoder (used for extra-vars files and ad-hoc `-a` JSON)
# loads {"__ansible_unsafe": s} as an unsafe (2.17/2.18) or untrusted (2.19+) string, which is never templated.
# YAML's `!unsafe` would do the same but 2.19 re-resolves the tagged scalar, turning "0755" into 493 and "true" into
# True; JSON keeps every type as given.
_UNSAFE = "__ansible_unsafe"


def _refuse_template(value: str, what: str) -> str:
    if any(m in value for m in TEMPLATE_MARKERS):
        # One line, no hint: the message says what to change.
        raise ShardstackError(f"{what} {value!r} contains a template marker ({{{{, {{% or {{#), which Ansible would "
                              "evaluate: no user string is ever a template, pass it without one")
    return value


def _inert_value(value: Any, where: str) -> Any:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return {_UNSAFE: value}
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a string")
            # JSON cannot mark a key unsafe: a key Ansible might render, or one its decoder reads as a marker
            # (__ansible_unsafe, __ansible_vault), is refused instead.
            _refuse_template(key, f"{where}: key")
            if key.startswith("__ansible_"):
                raise ShardstackError(f"{where}: key {key!r} is reserved by Ansible")
            out[key] = _inert_value(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_inert_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"{where}: {type(value).__name__} cannot be passed to Ansible")


def inert(variables: Mapping[str, Any], what: str = "extra variable") -> dict[str, Any]:
    """`variables` (names → JSON-like values) in ansible-core's JSON with every string, however deep, marked unsafe:
    Ansible uses them as values and never renders them. Names must be identifiers (a variable's or an option's)."""
    out = {}
    for name, value in variables.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardstackError(f"{what} name {name!r} is not an identifier")
        out[name] = _inert_value(value, name)
    return out


def _write_extravars(private_dir: Path, inert_vars: dict[str, Any]) -> None:
    """env/extravars, which ansible-runner passes as `-e @file`: written here, already `inert`, rather than through
    runner's extravars= (plain JSON, so every string would be a template). Owner-only: it may carry secrets."""
    env = private_dir / "env"
    env.mkdir(exist_ok=True)
    fd = os.open(env / "extravars", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(inert_vars, f)


def existing_inventory(inventory: Path) -> Path:
    inventory = inventory.resolve()
    if not inventory.exists():
        raise ShardstackError(
            f"inventory {inventory} does not exist",
            hint="for the local lab run `shardstack lab up` first; for a cluster copy inventory/sample")
    return inventory


@contextlib.contextmanager
def tools_on_path() -> Iterator[None]:
    """This interpreter's bin/ on PATH for the duration: ansible-runner finds ansible-inventory with shutil.which."""
    old = os.environ.get("PATH", os.defpath)
    os.environ["PATH"] = _tool_env()["PATH"]
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _tool_env() -> dict[str, str]:
    """ansible-playbook/ansible from this interpreter's environment, even when its bin/ is not on PATH."""
    here = str(Path(sys.executable).parent)
    return {"PATH": os.pathsep.join([here, os.environ.get("PATH", os.defpath)])}


def _ansible_env(root: Path) -> dict[str, str]:
    env = {**_tool_env(), "ANSIBLE_CONFIG": str(root / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    if not _is_checkout(root):  # ansible.cfg's relative fact cache would land in site-packages, beside the copy
        env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(state_dir() / "ansible-facts")
    return env


def unreachable_message(res: dict[str, Any]) -> str:
    """Why a host was unreachable, on one line: Mitogen's message quotes ssh's output below its own first line."""
    return " ".join(str(res.get("msg") or "no answer").split())[:2000]


def run_playbook(
    playbook: str,
    inventory: Path,
    *,
    tags: str | None = None,
    skip_tags: str | None = None,
    limit: str | None = None,
    check: bool = False,
    extravars: dict[str, Any] | None = None,
    on_event: Callable[[RunnerEvent], None] | None = None,
    artifacts: Path | None = None,
) -> RunResult:
    import ansible_runner  # deferred: the runtime commands must not need the ops extra

    root = project_dir()
    book = root / playbook
    if not book.is_file():
        raise ShardstackError(f"no playbook {playbook!r} in {root}")
    inventory = existing_inventory(inventory)
    inert_vars = inert(extravars or {})  # before the run directory: a refused value leaves nothing behind
    artifacts = _private_dir(artifacts or state_dir() / "runs")
    _write_extravars(artifacts, inert_vars)
    hosts: dict[str, HostResult] = {}
    published: dict[str, Any] = {}

    def handle(event: RunnerEvent) -> bool:
        data = event.get("event_data", {})
        host = data.get("host")
        if event.get("event") == "playbook_on_stats":
            published.update(data.get("artifact_data") or {})
        if event.get("event") in ("runner_on_failed", "runner_on_unreachable") and host and \
                not data.get("ignore_errors"):
            res = data.get("res", {})
            hr = hosts.setdefault(host, HostResult(host))
            hr.failed_task = data.get("task")
            hr.message = (unreachable_message(res) if event.get("event") == "runner_on_unreachable" else
                          str(res.get("msg") or res.get("stderr") or res.get("reason") or res)[:2000])
        if on_event:
            on_event(event)
        return True

    started = time.monotonic()
    runner = ansible_runner.run(
        private_data_dir=str(artifacts),
        project_dir=str(root),
        playbook=str(book),
        inventory=str(inventory),
        tags=tags,
        skip_tags=skip_tags,  # as one argument: a cmdline string would be split into options
        limit=limit,
        cmdline="--check --diff" if check else None,
        envvars={**_ansible_env(root), "ANSIBLE_ROLES_PATH": str(root / "roles")},
        event_handler=handle,
        quiet=True,
    )
    stats = runner.stats or {}
    for key, attr in (("ok", "ok"), ("changed", "changed"), ("failures", "failed"), ("dark", "unreachable"),
                      ("skipped", "skipped")):
        for host, n in (stats.get(key) or {}).items():
            setattr(hosts.setdefault(host, HostResult(host)), attr, n)
    for hr in hosts.values():  # ansible counts changed tasks inside ok
        hr.ok -= hr.changed
    return RunResult(playbook=playbook, status=runner.status, rc=runner.rc, seconds=time.monotonic() - started,
                     artifact_dir=str(runner.config.artifact_dir), hosts=dict(sorted(hosts.items())),
                     data=published)


@dataclass
class CommandResult:
    """One host's answer to an ad-hoc command."""

    host: str
    rc: int
    stdout: str = ""
    stderr: str = ""
    unreachable: bool = False
    message: str | None = None

    @property
    def success(self) -> bool:
        return self.rc == 0 and not self.unreachable


def run_command(
    argv: list[str],
    inventory: Path,
    pattern: str,
    *,
    become: bool = True,
    artifacts: Path | None = None,
    timeout: int | None = None,
) -> dict[str, CommandResult]:
    """Run one command on every host matching `pattern` (ansible-runner's ad-hoc mode) → per-host results. `argv`
    reaches the host as given: no shell, no template."""
    return run_module("ansible.builtin.command", {"argv": list(argv)}, inventory, pattern, become=become,
                      artifacts=artifacts, timeout=timeout)


def run_module(
    module: str,
    module_args: Mapping[str, Any],
    inventory: Path,
    pattern: str,
    *,
    become: bool = True,
    become_user: str | None = None,
    artifacts: Path | None = None,
    timeout: int | None = None,
) -> dict[str, CommandResult]:
    """Run one Ansible module (e.g. ansible.builtin.copy) with these options on every host matching `pattern` →
    per-host results, as root (`become`) or as `become_user`. The options reach the module literally (as `-a` JSON,
    every string unsafe); the pattern, which ad-hoc mode renders and nothing can mark, may hold no template marker."""
    import ansible_runner

    if not re.fullmatch(r"[A-Za-z_][\w.]*", module):
        raise ShardstackError(f"module {module!r} is not a module name")
    _refuse_template(pattern, "host pattern")
    if become_user is not None and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", become_user):
        raise ShardstackError(f"{become_user!r} is not an account name")
    cmdline = (f"--become --become-user {become_user}" if become_user else "--become") if become else None
    # Valid JSON always: ad-hoc mode falls back to k=v parsing (templated) for a `-a` that does not parse.
    args = json.dumps(inert(module_args, "module option"))
    root = project_dir()
    inventory = existing_inventory(inventory)
    artifacts = _private_dir(artifacts or state_dir() / "adhoc")
    results: dict[str, CommandResult] = {}

    def handle(event: RunnerEvent) -> bool:
        kind, data = event.get("event"), event.get("event_data", {})
        host, res = data.get("host"), data.get("res") or {}
        if kind in ("runner_on_ok", "runner_on_failed"):
            results[host] = CommandResult(host, int(res.get("rc", 0 if kind == "runner_on_ok" else 1)),
                                          res.get("stdout", ""), res.get("stderr", ""),
                                          message=None if kind == "runner_on_ok" else str(res.get("msg", ""))[:500])
        elif kind == "runner_on_unreachable":
            results[host] = CommandResult(host, -1, unreachable=True, message=unreachable_message(res)[:500])
        return True

    ansible_runner.run(
        private_data_dir=str(artifacts), host_pattern=pattern, inventory=str(inventory),
        module=module, module_args=args,
        cmdline=cmdline, timeout=timeout,
        # One task: Mitogen (ansible.cfg's strategy) would start its interpreter on every node for it, which costs
        # more than it saves and, on a node busy enough, outlasts the connection timeout. Plain ssh and a module.
        envvars={**_ansible_env(root), "ANSIBLE_STRATEGY": "linear"},
        event_handler=handle, quiet=True,
    )
    return dict(sorted(results.items()))
