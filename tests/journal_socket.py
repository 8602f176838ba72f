"""A unix datagram socket that stands in for journald's native socket (/run/systemd/journal/socket) in tests: the
inference service and HAProxy write their access logs to it as they would to journald."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

from shardstack.serve.accesslog import decode_entry


class JournalSocket:
    """Keeps every datagram. Read by a thread at once, as journald does: the kernel queues only a few datagrams
    (net.unix.max_dgram_qlen) and both writers drop what does not fit rather than wait."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.raw: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self.raw.append(self.sock.recv(65536))

    def entries(self) -> list[dict[str, str]]:
        return [decode_entry(d) for d in list(self.raw)]

    def entry(self, key: str, value: str, timeout: float = 60.0) -> dict[str, str]:  # a ceiling, for loaded hosts
        """The first entry with key=value (written once the response is sent, so it may trail the client)."""
        deadline = time.monotonic() + timeout
        while True:
            for fields in self.entries():
                if fields.get(key) == value:
                    return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"no entry with {key}={value}: {self.entries()}")
            time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()
