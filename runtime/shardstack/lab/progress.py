"""Progress for long lab steps: a live spinner on a terminal, periodic plain lines in logs (CI)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console


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
