"""The access log: one entry per request, as structured journal fields or as a line on stdout.

Under journald each request is one entry with SHARDSTACK_METHOD, _PATH, _STATUS, _DURATION_MS, _REQUEST_ID,
_CLIENT (the peer; behind HAProxy that is the load balancer), _FORWARDED_FOR (X-Forwarded-For, which HAProxy sets
and clients cannot), _PROMPT_TOKENS / _COMPLETION_TOKENS for completions, _RESPONSE_BYTES, and a readable MESSAGE,
so `journalctl SHARDSTACK_STATUS=503` filters without a regex. Never logged: request bodies (prompts), the
Authorization header, the query string, any other header.

Written with journald's native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/), as notify.py speaks
sd_notify: one datagram of KEY=value lines to /run/systemd/journal/socket. Not `systemd-python`: PyPI has only its
sdist, which needs libsystemd-dev and a compiler on every inference node, for a protocol of a dozen lines that
systemd documents as stable. The socket is non-blocking: when journald falls behind, an entry is dropped (and
counted) rather than stalling the event loop that serves tokens.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.types import Scope

log = logging.getLogger(__name__)
access_log = logging.getLogger("shardstack.serve.access")  # the stdout sink

JOURNAL_SOCKET = "/run/systemd/journal/socket"
MODES = ("auto", "journal", "stdout", "off")
SYSLOG_IDENTIFIER = "shardstack-inference"  # as the unit's SyslogIdentifier=, for `journalctl -t`
REQUEST_ID_HEADER = "x-request-id"
SCOPE_KEY = "shardstack.access"  # per-request fields routes add (token counts), in the ASGI scope
# Probes and scrapes that succeed are not worth an entry a second per load balancer; failing ones are logged.
QUIET_PATHS = ("/health", "/metrics")
# HAProxy's unique-id-format (roles/loadbalancer) makes e.g. 0A000005:C1F2_0A000003:01BB_674C8E21_0001:1B3C.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# The named API key a request came with, set by the load balancer (roles/loadbalancer, loadbalancer_api_keys; it
# drops any the client sent): its name, never the key. Anything else is "-".
API_KEY_HEADER = b"x-shardstack-client"
API_KEY_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_FIELD = re.compile(r"[A-Z0-9][A-Z0-9_]*")
_PATH_MAX = 256


def encode_entry(fields: Mapping[str, object]) -> bytes:
    """A native-protocol datagram: KEY=value lines, or KEY, a little-endian 64-bit length and the raw value for a
    value holding a newline."""
    out = bytearray()
    for key, value in fields.items():
        if not _FIELD.fullmatch(key):
            raise ValueError(f"invalid journal field name {key!r}")
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def decode_entry(data: bytes) -> dict[str, str]:
    """The inverse of encode_entry (for tests and tools reading the same datagrams)."""
    fields: dict[str, str] = {}
    i = 0
    while i < len(data):
        end = data.index(b"\n", i)
        line = data[i:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            i = end + 1
        else:
            (size,) = struct.unpack("<Q", data[end + 1:end + 9])
            fields[line.decode()] = data[end + 9:end + 9 + size].decode()
            i = end + 9 + size + 1
    return fields


class JournalSink:
    """Sends entries to journald's native socket (or any unix datagram socket, for tests)."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    def send(self, fields: Mapping[str, object]) -> bool:
        try:
            self._sock.sendto(encode_entry(fields), self.path)
            return True
        except OSError as exc:  # journald busy (EAGAIN) or gone: never fatal for serving
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("access log: %d entr%s not written to %s (last: %s)", self.dropped,
                            "y" if self.dropped == 1 else "ies", self.path, exc.strerror or exc)
            return False

    def close(self) -> None:
        self._sock.close()


def resolve_mode(mode: str, socket_path: str, environ: Mapping[str, str] | None = None) -> str:
    """auto → journal when stdout goes to journald ($JOURNAL_STREAM, as systemd sets it) and its socket is there,
    else off; journal without the socket → stdout (with a warning)."""
    env = os.environ if environ is None else environ
    if mode not in MODES:
        raise ValueError(f"access log mode {mode!r}: one of {', '.join(MODES)}")
    have_socket = os.path.exists(socket_path)
    if mode == "auto":
        return "journal" if env.get("JOURNAL_STREAM") and have_socket else "off"
    if mode == "journal" and not have_socket:
        log.warning("access log: no journal socket at %s; logging requests to stdout instead", socket_path)
        return "stdout"
    return mode


def request_fields(scope: Scope) -> dict[str, Any]:
    """The dict routes add fields to (e.g. token counts); a throwaway one outside the access log."""
    return scope.get(SCOPE_KEY, {})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def api_key_name(scope: Scope) -> str:
    """The name of the API key the load balancer passed the request on for, or "-"."""
    name = _header(scope, API_KEY_HEADER)
    return name if name and API_KEY_NAME.fullmatch(name) else "-"


def request_id(scope: Scope) -> str:
    """The client's or HAProxy's X-Request-ID when well-formed, else a new one."""
    given = _header(scope, REQUEST_ID_HEADER.encode())
    return given if given and REQUEST_ID_PATTERN.fullmatch(given) else uuid.uuid4().hex


class AccessLog:
    """Writes one entry per finished request (app.py observes the response and calls `write`)."""

    def __init__(self, mode: str, sink: JournalSink | None = None) -> None:
        self.mode = mode
        self.sink = sink

    def write(self, scope: Scope, status: int, sent: int, ms: float, request_id: str, extra: dict[str, Any]) -> None:
        if self.mode == "off" or (scope["path"] in QUIET_PATHS and 200 <= status < 300):
            return
        method = scope["method"][:16]
        path = scope["path"][:_PATH_MAX]
        client = scope["client"][0] if scope.get("client") else "-"
        forwarded = (_header(scope, b"x-forwarded-for") or "")[:256]
        tokens = ""
        if "prompt_tokens" in extra:
            tokens = f" tokens={extra['prompt_tokens']}+{extra.get('completion_tokens', 0)}"
        key = api_key_name(scope)
        message = (f'{forwarded or client} "{method} {path}" {status} {ms:.1f}ms {sent}B{tokens} '
                   f"id={request_id}" + (f" key={key}" if key != "-" else ""))
        if self.mode == "stdout" or self.sink is None:
            access_log.info("%s", message)
            return
        fields: dict[str, object] = {
            "MESSAGE": message,
            "PRIORITY": 4 if status >= 500 else 6,  # warning / info
            "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
            "SHARDSTACK_METHOD": method,
            "SHARDSTACK_PATH": path,
            "SHARDSTACK_STATUS": status,
            "SHARDSTACK_DURATION_MS": f"{ms:.1f}",
            "SHARDSTACK_REQUEST_ID": request_id,
            "SHARDSTACK_CLIENT": client,
            "SHARDSTACK_RESPONSE_BYTES": sent,
        }
        if forwarded:
            fields["SHARDSTACK_FORWARDED_FOR"] = forwarded
        if key != "-":
            fields["SHARDSTACK_API_KEY"] = key
        for key in ("prompt_tokens", "completion_tokens", "finish_reason"):
            if key in extra:
                fields[f"SHARDSTACK_{key.upper()}"] = extra[key]
        self.sink.send(fields)
