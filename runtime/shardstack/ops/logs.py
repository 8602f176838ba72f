"""The central log store from the controller: `journalctl` on the log collector (the first monitoring_server)
through ansible-runner, its JSON parsed into typed entries.

The collector holds every other node's journal under /var/log/journal/remote/ (one file per host, written by
systemd-journal-remote) and its own journal where journald keeps it (it does not upload to itself), so a query reads
both: `journalctl --merge`. An entry's own fields (everything but journald's trusted `_…` ones) come along.

A query for one host reads that host's files only, through the journal role's collector tool (`query`): the files
its authenticated stream was written to, never entries that merely call themselves by its name (`_HOSTNAME` is
whatever the sender wrote), and those entries carry the host's inventory name.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import check_job_name
from shardstack.ops.jobs.common import unit as job_unit
from shardstack.ops.runner import run_command

COLLECTOR_GROUP = "monitoring_server"
# The journal role's collector tool and its map of journal sources to inventory names (roles/journal/vars/main.yml
# __journal_tool, __journal_sources, __journal_store_dir; a test keeps them equal).
COLLECTOR_TOOL = "/usr/local/libexec/shardstack/log-collector"
COLLECTOR_SOURCES = "/etc/shardstack-journal/sources.json"
COLLECTOR_STORE = "/var/log/journal/remote"
# Journal fields every entry has, shown in their own columns or of no use to a reader; the rest are the entry's own.
_SHOWN = {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "SYSLOG_FACILITY", "SYSLOG_PID", "SYSLOG_TIMESTAMP"}
_UNIT_FIELDS = ("_SYSTEMD_UNIT", "UNIT", "_SYSTEMD_USER_UNIT")
_SINCE_RE = re.compile(r"^(-?\d+\s*(s|sec|m|min|h|hour|d|day|w|week)s?( ago)?|now|today|yesterday|"
                       r"\d{4}-\d\d-\d\d([ T]\d\d:\d\d(:\d\d)?)?|@\d+)$")


@dataclass
class LogQuery:
    host: str | None = None        # the node's inventory name: its own journal files at the collector
    unit: str | None = None        # systemd unit (journalctl --unit: the service's own lines and systemd's about it)
    job: str | None = None         # a training job: its unit shardstack-train@<job>.service on every train node
    identifier: str | None = None  # SYSLOG_IDENTIFIER (logger -t, a unit's SyslogIdentifier=)
    since: str | None = None       # journalctl --since: "-10min", "2025-01-31 12:00", "today"
    grep: str | None = None        # journalctl --grep: a PCRE2 regular expression on MESSAGE
    lines: int = 100               # newest N (ignored when following)

    def check(self) -> None:
        if self.job is not None:
            if self.unit:
                raise ShardstackError("--job and --unit both name a unit: give one",
                                      hint=f"--job {self.job} is --unit {job_unit(self.job)}")
            check_job_name(self.job)
        if self.since and not _SINCE_RE.match(self.since.strip()):
            raise ShardstackError(f"--since {self.since!r} is not a time journalctl reads",
                                  hint='e.g. "-10min", "-2h", "today", "2025-01-31 12:00", "@1735689600"')
        if self.grep is not None:
            try:
                re.compile(self.grep)
            except re.error as exc:
                raise ShardstackError(f"--grep {self.grep!r} is not a regular expression: {exc}") from None
        if self.lines < 1:
            raise ShardstackError("--lines must be at least 1")


@dataclass
class LogEntry:
    time: float                 # seconds since the epoch (the entry's __REALTIME_TIMESTAMP)
    host: str
    unit: str
    identifier: str
    priority: int | None
    message: str
    cursor: str
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def iso(self) -> str:
        return datetime.fromtimestamp(self.time, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["time"] = self.iso
        return out


def journalctl_argv(q: LogQuery, cursor: str | None = None) -> list[str]:
    """The command the collector runs: newest `lines` entries, or everything after `cursor` when following; for
    one host, journalctl on that host's own files through the collector tool."""
    argv = ["journalctl", "--no-pager", "--quiet", "--output=json"]
    unit = job_unit(q.job) if q.job else q.unit
    if unit:
        argv.append(f"--unit={unit}")
    if q.identifier:
        argv.append(f"--identifier={q.identifier}")
    if q.since and not cursor:
        argv.append(f"--since={q.since.strip()}")
    if q.grep is not None:
        argv.append(f"--grep={q.grep}")
    argv += [f"--after-cursor={cursor}"] if cursor else [f"--lines={q.lines}"]
    if q.host:
        return [COLLECTOR_TOOL, f"--store={COLLECTOR_STORE}", "query", f"--sources={COLLECTOR_SOURCES}",
                f"--host={q.host}", "--", *argv]
    return [argv[0], "--merge", *argv[1:]]


def _text(value: Any) -> str:
    """A field's value: journalctl's JSON gives binary values as byte arrays and repeated fields as lists."""
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return bytes(value).decode("utf-8", "replace")
        return " ".join(_text(v) for v in value)
    return "" if value is None else str(value)


def parse_entry(raw: dict[str, Any]) -> LogEntry:
    message = _text(raw.get("MESSAGE"))
    fields = {k: _text(v) for k, v in raw.items() if not k.startswith("_") and k not in _SHOWN}
    try:
        priority = int(raw["PRIORITY"]) if "PRIORITY" in raw else None
    except (TypeError, ValueError):
        priority = None
    return LogEntry(
        time=int(raw.get("__REALTIME_TIMESTAMP", 0)) / 1e6,
        host=_text(raw.get("_HOSTNAME")),
        unit=next((_text(raw[f]) for f in _UNIT_FIELDS if raw.get(f)), ""),
        identifier=_text(raw.get("SYSLOG_IDENTIFIER") or raw.get("_COMM")),
        priority=priority,
        message=message,
        cursor=_text(raw.get("__CURSOR")),
        fields=fields,
    )


def parse_output(stdout: str) -> list[LogEntry]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict):
            out.append(parse_entry(raw))
    return out


# The collector as a host pattern: the ad-hoc run resolves it itself, so a query never reads the Cluster's listing
# (seconds of ansible-runner start-up).
COLLECTOR = f"{COLLECTOR_GROUP}[0]"


def _query(argv: list[str], inventory: Path, host: str, node: str | None = None) -> list[LogEntry]:
    """`argv` on the collector `host`; entries of one `node`'s files carry its name."""
    results = run_command(argv, inventory, host, timeout=120)
    if not results:
        raise ShardstackError(f"no log collector: {host} matches no host of the inventory",
                              hint=f"the log collector is the first host of {COLLECTOR_GROUP}")
    name, res = next(iter(results.items()))
    if node is not None and res.rc == 2 and not res.unreachable:  # the collector tool's answer: no such journal
        raise ShardstackError(f"--host {node}: {res.stderr.strip()[:300]}",
                              hint="--host takes a node's inventory name")
    # journalctl exits 1 when --grep matched nothing; that is an empty answer, not an error.
    if res.unreachable or (res.rc not in (0, 1)) or (res.rc == 1 and res.stderr.strip()):
        # Exit 1 (the CLI's EXIT_FAILED_HOSTS): a host failed (down, or no journal store), not the user's input.
        raise ShardstackError(f"journalctl on the log collector {name} failed: "
                              f"{(res.stderr or res.message or '').strip()[:300]}",
                              hint="is the journal role deployed there? (shardstack deploy --tags logs)", exit_code=1)
    entries = parse_output(res.stdout)
    if node is not None:
        for entry in entries:
            entry.host = node
    return entries


def query(q: LogQuery, cluster: Cluster, *, host: str | None = None) -> list[LogEntry]:
    """The newest `q.lines` entries that match, oldest first."""
    q.check()
    return _query(journalctl_argv(q), cluster.path, host or COLLECTOR, q.host)


def follow(q: LogQuery, cluster: Cluster, *, poll: float = 2.0, host: str | None = None,
           stop: Callable[[], bool] | None = None) -> Iterator[LogEntry]:
    """The newest entries, then every new one as it arrives: ansible-runner cannot stream a command's output, so
    this asks again after the last cursor every `poll` seconds (each ask costs an ansible-runner start)."""
    q.check()
    host = host or COLLECTOR
    inventory = cluster.path
    cursor = None
    while True:
        entries = _query(journalctl_argv(q, cursor), inventory, host, q.host)
        yield from entries
        if entries:
            cursor = entries[-1].cursor
        elif cursor is None:
            # Nothing matched yet: follow from now on, as journalctl --follow would.
            cursor = _now_cursor(inventory, host)
        if stop and stop():
            return
        time.sleep(poll)


def _now_cursor(inventory: Path, host: str) -> str | None:
    last = _query(["journalctl", "--merge", "--no-pager", "--quiet", "--output=json", "--lines=1"], inventory, host)
    return last[-1].cursor if last else None
