"""How the lab reports progress on its long steps: any object with `step(title)` (a context manager whose value
has `update(detail)`), `done(message)` and `warn(message)`. The CLI passes a rich one; `Silent` says nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol


class Reporter(Protocol):
    def step(self, title: str) -> contextlib.AbstractContextManager[Any]: ...
    def done(self, message: str) -> None: ...
    def warn(self, message: str) -> None: ...


class _NoStep:
    def update(self, detail: str) -> None:
        pass


class Silent:
    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[_NoStep]:
        yield _NoStep()

    def done(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass
