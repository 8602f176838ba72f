"""systemd's notify protocol (sd_notify(3)) in a few lines: datagrams to $NOTIFY_SOCKET.

READY=1 once the model is loaded and warmed up, WATCHDOG=1 while the engine loop makes progress (or idles
responsively), STOPPING=1 when a drain starts. Without $NOTIFY_SOCKET (not under systemd) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):  # abstract namespace socket
            addr = "\0" + addr[1:]
        self.address = addr or None
        self.watchdog_seconds = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env: dict[str, str]) -> float | None:
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 1e6
        except ValueError:
            return None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as exc:  # systemd gone or socket unreadable: never fatal for serving
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")
