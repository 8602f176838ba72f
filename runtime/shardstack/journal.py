"""Structured entries for the systemd journal through journald's native protocol, with the standard library only.

A service's stdout reaches the journal as MESSAGE alone. Entries sent to journald's native socket carry fields of
their own (REQUEST_ID=…, STATUS=…, LATENCY_MS=…) that `journalctl FIELD=value`, `shardstack logs --json` and the
forwarders see. `python3-systemd` (systemd.journal) does this, but it is a Debian package outside the venv the nodes
install from the wheelhouse, and PyPI's `systemd-python` needs libsystemd headers to build; the protocol is one
datagram of newline-separated fields (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/), which is less code than either.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import struct
from collections.abc import Mapping

SOCKET = "/run/systemd/journal/socket"
_FIELD_RE = re.compile(r"^[A-Z0-9][A-Z0-9_]{0,63}$")  # journald drops fields named otherwise (and _-prefixed ones)
# logging level -> syslog priority (journald's PRIORITY=)
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def field_name(name: str) -> str:
    """A journal field name from a key: upper case, [A-Z0-9_], not starting with '_' (journald keeps those for
    itself)."""
    clean = re.sub(r"[^A-Z0-9_]", "_", name.upper()).lstrip("_")
    if not _FIELD_RE.match(clean):
        raise ValueError(f"{name!r} cannot be a journal field name")
    return clean


def encode(fields: Mapping[str, object]) -> bytes:
    """The native protocol's datagram: `KEY=value\\n`, or `KEY\\n<64-bit little-endian length>value\\n` for a value
    with a newline in it."""
    out = bytearray()
    for key, value in fields.items():
        if value is None:
            continue
        name = field_name(key).encode()
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


def send(fields: Mapping[str, object], path: str = SOCKET) -> bool:
    """Send one entry; False when journald's queue is full and the entry was dropped (a server's event loop must not
    wait for its logs). A datagram too large for the socket goes the way journald accepts big entries: in a sealed
    memfd whose descriptor is passed instead."""
    data = encode(fields)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(data, path)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            fd = os.memfd_create("journal-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.write(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
                sock.connect(path)
                socket.send_fds(sock, [b""], [fd])
            except BlockingIOError:
                return False
            finally:
                os.close(fd)
    return True


def available(path: str = SOCKET) -> bool:
    """Under systemd with the journal listening: the service's output goes to the journal ($JOURNAL_STREAM) and the
    native socket exists."""
    return bool(os.environ.get("JOURNAL_STREAM")) and os.path.exists(path)


class JournalHandler(logging.Handler):
    """A logging handler that writes each record as a journal entry: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, LOGGER,
    CODE_FILE/CODE_LINE/CODE_FUNC, plus the record's `journal` mapping (`log.info(..., extra={"journal": {...}})`)."""

    def __init__(self, identifier: str, path: str = SOCKET, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.identifier = identifier
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, object] = {
                "MESSAGE": self.format(record),
                "PRIORITY": _PRIORITY.get(record.levelno, 6),
                "SYSLOG_IDENTIFIER": self.identifier,
                "LOGGER": record.name,
                "CODE_FILE": record.pathname,
                "CODE_LINE": record.lineno,
                "CODE_FUNC": record.funcName,
            }
            for key, value in (getattr(record, "journal", None) or {}).items():
                with contextlib.suppress(ValueError):  # a key that cannot be a field name is left out
                    fields[field_name(key)] = value
            send(fields, self.path)
        except Exception:
            self.handleError(record)


def attach(logger: logging.Logger, identifier: str, path: str = SOCKET) -> bool:
    """Send `logger`'s records to the journal as structured entries, instead of as plain text on stderr, when the
    process runs under systemd with the journal; elsewhere (a terminal, the tests) leave the logger alone."""
    if not available(path) or any(isinstance(h, JournalHandler) for h in logger.handlers):
        return False
    logger.addHandler(JournalHandler(identifier, path))
    logger.propagate = False
    if logger.level == logging.NOTSET:  # its own records, whatever the root logger's level
        logger.setLevel(logging.INFO)
    return True
