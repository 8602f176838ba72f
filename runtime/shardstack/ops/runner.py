"""Run the project's playbooks through ansible-runner and return typed results.

This is the Python API the CLI is built on: `run_playbook("site.yml", inventory)` → `RunResult` with per-host
ok/changed/failed counts and, for each failed host, the task and message that failed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
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
    artifacts = _private_dir(artifacts or state_dir() / "runs")
    cmdline = " ".join(x for x in ("--check --diff" if check else "", f"--skip-tags {skip_tags}" if skip_tags else "")
                       if x)
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
            hr.message = str(res.get("msg") or res.get("stderr") or res.get("reason") or res)[:2000]
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
        limit=limit,
        cmdline=cmdline or None,
        extravars=extravars or {},
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
    """Run one command on every host matching `pattern` (ansible-runner's ad-hoc mode) → per-host results."""
    import shlex

    return run_module("ansible.builtin.command", shlex.join(argv), inventory, pattern, become=become,
                      artifacts=artifacts, timeout=timeout)


def run_module(
    module: str,
    module_args: str,
    inventory: Path,
    pattern: str,
    *,
    become: bool = True,
    artifacts: Path | None = None,
    timeout: int | None = None,
) -> dict[str, CommandResult]:
    """Run one Ansible module (e.g. ansible.builtin.copy) on every host matching `pattern` → per-host results."""
    import ansible_runner

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
            results[host] = CommandResult(host, -1, unreachable=True, message=str(res.get("msg", ""))[:500])
        return True

    ansible_runner.run(
        private_data_dir=str(artifacts), host_pattern=pattern, inventory=str(inventory),
        module=module, module_args=module_args,
        cmdline="--become" if become else None, timeout=timeout,
        envvars=_ansible_env(root),
        event_handler=handle, quiet=True,
    )
    return dict(sorted(results.items()))
