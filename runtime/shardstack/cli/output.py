"""What the CLI shows: the console, progress for long lab steps and for playbook runs, summary tables, exit codes.

Exit codes mean something to automation: 0 ok, 1 a host or check failed, 2 usage or environment error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from shardstack.ops.runner import RunnerEvent, RunResult
    from shardstack.ops.storage import Verified

console = Console(stderr=True)  # progress, tables and messages
stdout = Console()  # reports a command exists to print (e.g. `lab status`)


def report_copy(done: Verified, *, as_json: bool, use_as: str = "") -> None:
    """What `model put` and `data put` print: the path on shared storage on stdout (or the whole record as JSON),
    what was checked on stderr, and `use_as` (the job-config key the path belongs in)."""
    if as_json:
        print(json.dumps(dataclasses.asdict(done), indent=2))
        return
    print(done.path)
    use = f"; use it as {use_as}: {done.path}" if use_as else ""
    console.print(f"{done.files} file(s), {done.bytes / 2**20:.1f} MiB, sha256 checked on the cluster{use}",
                  highlight=False)
    if done.extra:
        console.print(f"also there (from an earlier copy): {', '.join(done.extra)}", highlight=False)

EXIT_OK, EXIT_FAILED_HOSTS, EXIT_USAGE = 0, 1, 2


class _Step:
    def __init__(self, console: Console, title: str, status) -> None:
        self._console, self._title, self._status = console, title, status
        self._started = self._last_print = time.monotonic()

    def update(self, detail: str) -> None:
        elapsed = time.monotonic() - self._started
        if self._status is not None:
            self._status.update(f"{self._title} [dim]{elapsed:4.0f}s {detail}[/]")
        elif time.monotonic() - self._last_print >= 10:
            self._last_print = time.monotonic()
            self._console.print(f"  … {elapsed:.0f}s {detail}", highlight=False)


class Progress:
    """Progress of long lab steps (shardstack.lab's Reporter): a live spinner on a terminal, periodic plain lines
    in logs (CI)."""

    def __init__(self, quiet: bool = False) -> None:
        self.console = Console(stderr=True, quiet=quiet)

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[_Step]:
        started = time.monotonic()
        if self.console.is_terminal:
            with self.console.status(title) as status:
                yield _Step(self.console, title, status)
        else:
            self.console.print(f"- {title}", highlight=False)
            yield _Step(self.console, title, None)
        self.console.print(f"[green]✓[/] {title} ({time.monotonic() - started:.1f}s)", highlight=False)

    def done(self, message: str) -> None:
        self.console.print(f"[green]✓[/] {message}", highlight=False)

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]![/] {message}", highlight=False)


class LiveProgress:
    """A playbook run as it happens: one line per task as it starts and one per host that changes or fails, with
    elapsed time."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, event: RunnerEvent) -> None:
        kind, data = event.get("event"), event.get("event_data", {})
        t = f"[dim]{time.monotonic() - self.started:6.1f}s[/]"
        if kind == "playbook_on_play_start":
            console.print(f"{t} [bold]PLAY {data.get('play', '')}[/]", highlight=False)
        elif kind == "playbook_on_task_start":
            console.print(f"{t}   {data.get('task', '')}", highlight=False)
        elif kind == "runner_on_ok" and data.get("res", {}).get("changed"):
            console.print(f"{t}     [yellow]changed[/] {data.get('host')}", highlight=False)
        elif kind == "runner_on_skipped" and (reason := data.get("res", {}).get("skip_reason")):
            console.print(f"{t}     [cyan]skipped[/] {data.get('host')}: {reason}", highlight=False)
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            msg = data.get("res", {}).get("msg", "")
            console.print(f"{t}     [red]{kind.split('_')[-1]}[/] {data.get('host')}: {msg}", highlight=False)


def summary_table(result: RunResult, title: str) -> Table:
    table = Table(title=f"{title}: {result.status} in {result.seconds:.1f}s — artifacts {result.artifact_dir}")
    for col in ("host", "ok", "changed", "failed", "unreachable", "skipped", "failed task"):
        table.add_column(col)
    for h in result.hosts.values():
        table.add_row(h.host, str(h.ok), str(h.changed), str(h.failed), str(h.unreachable), str(h.skipped),
                      f"{h.failed_task}: {h.message}" if h.failed_task else "")
    return table
