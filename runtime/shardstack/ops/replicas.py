"""Inference replicas that come and go, in HAProxy's backend without a reload: a reload would close the connections
of requests in flight, so a replica is added with the runtime API's `add server`, sent traffic only once its
health checks pass, and before it stops drained and deleted (`del server`). The options are those the
loadbalancer role gives its static servers (TLS verified against the cluster CA for the replica's inventory name,
the same checks and connection limit): a dynamic server takes nothing from `default-server`.

`send` is one runtime-API line in, HAProxy's answer out: the admin socket on the load balancer (`local_socket`), or
the same line through ssh as `shardstack node` sends its own (`cordon.socket_argv`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardstack.errors import ShardstackError
from shardstack.ops.cordon import check_name

Send = Callable[[str], str]


@dataclass(frozen=True)
class Replica:
    name: str  # the node's inventory name: its certificate's DNS name, checked with verifyhost
    addr: str
    port: int
    maxconn: int  # what the replica admits, running + waiting (the role's static servers get the same)


@dataclass(frozen=True)
class ServerOptions:
    """The role's `default-server`/`server` options (haproxy.cfg.j2), which a dynamic server must be given."""

    ca_file: str
    inter_ms: int = 2000
    fall: int = 2
    rise: int = 2


def local_socket(path: str, timeout: float = 5.0) -> Send:
    """Send each line on its own connection to the admin socket at `path` (HAProxy closes it after one command)."""

    def send(line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    return send


def add_command(backend: str, replica: Replica, opts: ServerOptions) -> str:
    check_name("backend", backend)
    check_name("server", replica.name)
    check_name("address", replica.addr)
    if not 0 < replica.port < 65536 or replica.maxconn < 1:
        raise ShardstackError(f"replica {replica.name}: port {replica.port} or maxconn {replica.maxconn} out of range")
    if any(c.isspace() for c in opts.ca_file):
        raise ShardstackError(f"CA file path {opts.ca_file!r} has white space, which a runtime-API line cannot carry")
    return (f"add server {backend}/{replica.name} {replica.addr}:{replica.port} maxconn {replica.maxconn} "
            f"ssl verify required ca-file {opts.ca_file} verifyhost {replica.name} "
            f"check check-ssl inter {opts.inter_ms} fall {opts.fall} rise {opts.rise}")


def _ok(send: Send, line: str, accepted: tuple[str, ...] = ("",)) -> str:
    answer = send(line).strip()
    if not any(answer.startswith(a) if a else answer == "" for a in accepted):
        raise ShardstackError(f"HAProxy refused `{line.split(' ssl ')[0]}`: {answer or 'no answer'}", exit_code=1)
    return answer


def servers(send: Send, backend: str) -> dict[str, dict[str, str]]:
    """`show stat` of `backend`'s servers: name → {status (UP, DOWN, MAINT, DRAIN …), scur (sessions now)}."""
    check_name("backend", backend)
    rows = send("show stat").splitlines()
    if not rows or not rows[0].startswith("# "):
        raise ShardstackError(f"HAProxy's `show stat` answered {rows[:1]!r}", exit_code=1)
    header = rows[0][2:].split(",")
    out = {}
    for row in rows[1:]:
        fields = dict(zip(header, row.split(","), strict=False))
        if fields.get("pxname") == backend and fields.get("svname") not in (None, "FRONTEND", "BACKEND"):
            out[fields["svname"]] = {"status": fields.get("status", ""), "scur": fields.get("scur", "0")}
    return out


def checked_up(send: Send, backend: str, name: str) -> bool:
    """`show servers state`: `name` is running (srv_op_state 2) and its last health check passed (result 3)."""
    rows = send(f"show servers state {backend}").splitlines()
    header = next((r[2:].split() for r in rows if r.startswith("# ")), [])
    for row in rows:
        fields = dict(zip(header, row.split(), strict=False))
        if fields.get("srv_name") == name:
            return fields.get("srv_op_state") == "2" and fields.get("srv_check_result") == "3"
    return False


def _wait(what: str, done: Callable[[], bool], timeout: float, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise ShardstackError(f"{what}: not within {timeout:g} s", exit_code=1)
        time.sleep(poll)


def add(send: Send, backend: str, replica: Replica, opts: ServerOptions, timeout: float = 120.0) -> None:
    """Add `replica` and return once HAProxy sends it traffic. It is created in maintenance; it leaves that for
    drain (checks run, no new requests: HAProxy counts a server that leaves maintenance as up until a check says
    otherwise) and becomes ready only once a health check has passed."""
    _ok(send, add_command(backend, replica, opts), accepted=("New server registered.",))
    _ok(send, f"enable health {backend}/{replica.name}")
    _ok(send, f"set server {backend}/{replica.name} state drain")
    _wait(f"replica {replica.name}'s health check to pass (HAProxy's {backend})",
          lambda: checked_up(send, backend, replica.name), timeout)
    _ok(send, f"set server {backend}/{replica.name} state ready")


def remove(send: Send, backend: str, name: str, timeout: float = 300.0) -> None:
    """Drain `name` (no new requests; those it holds finish), wait for its last session, then delete it."""
    check_name("server", name)
    if name not in servers(send, backend):
        return  # already gone: removing is idempotent
    _ok(send, f"set server {backend}/{name} state drain")
    _wait(f"replica {name}'s requests in flight to finish",
          lambda: servers(send, backend).get(name, {}).get("scur", "0") == "0", timeout)
    _ok(send, f"set server {backend}/{name} state maint")
    _ok(send, f"shutdown sessions server {backend}/{name}")  # none left; `del server` wants it idle for certain
    _ok(send, f"disable health {backend}/{name}")
    _ok(send, f"del server {backend}/{name}", accepted=("Server deleted.",))
