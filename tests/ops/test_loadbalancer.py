"""The load balancer's haproxy.cfg, rendered from the role and run by the real HAProxy on loopback in front of
two small HTTP backends: active health checks, retries of 503/refused requests on the other server, and the
per-client rate limit answering 429."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import render

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend(http.server.ThreadingHTTPServer):
    """/health answers `health`; POST answers `post` with the backend's name (503 = draining)."""

    def __init__(self, addr: str, port: int, name: str) -> None:
        self.name, self.health, self.post, self.hits = name, 200, 200, Counter()
        super().__init__((addr, port), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # health checks hang up early; that is not the backend's failure


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Backend

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(self.server.health, {"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.hits[self.server.post] += 1
        self._send(self.server.post, {"backend": self.server.name})

    def log_message(self, *args: object) -> None:
        pass


def post(url: str) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=b'{"prompt": "x"}', method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), {k.lower(): v for k, v in exc.headers.items()}


def wait_up(stats: str, servers: set[str], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"{stats}/metrics", timeout=2).read().decode()
        except OSError:
            text = ""
        up = {line.split('server="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("haproxy_server_status{") and 'state="UP"} 1' in line}
        if up == servers:
            return
        time.sleep(0.2)
    raise AssertionError(f"servers UP in HAProxy: {up}, wanted {servers}")


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[dict]:
    if not Path(HAPROXY).exists():
        pytest.fail("haproxy not found: apt-get install haproxy (the loadbalancer role's package)")
    backend_port, port, stats_port = free_port(), free_port(), free_port()
    a, b = Backend("127.0.0.2", backend_port, "a"), Backend("127.0.0.3", backend_port, "b")
    cfg = render("loadbalancer", "haproxy.cfg.j2",
                 groups={"inference_nodes": ["a", "b"]},
                 hostvars={"a": {"ansible_host": "127.0.0.2"}, "b": {"ansible_host": "127.0.0.3"}},
                 loadbalancer_bind="127.0.0.1", loadbalancer_port=port, loadbalancer_stats_bind="127.0.0.1",
                 loadbalancer_stats_port=stats_port, loadbalancer_backend_port=backend_port,
                 loadbalancer_admin_socket=str(tmp_path / "admin.sock"), loadbalancer_health_interval_ms=200,
                 loadbalancer_rate_limit_requests=40)
    # Not as a daemon, not chrooted, not switching users: the test's own process tree, cleaned up below.
    local_only = ("daemon", "chroot /var/lib/haproxy", "user haproxy", "group haproxy")
    cfg = "\n".join(line for line in cfg.splitlines() if line.strip() not in local_only) + "\n"
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg)
    check = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stats = f"http://127.0.0.1:{stats_port}"
    try:
        wait_up(stats, {"a", "b"})
        yield {"url": f"http://127.0.0.1:{port}/v1/completions", "stats": stats, "a": a, "b": b}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        a.shutdown()
        b.shutdown()
        a.server_close()
        b.server_close()


def test_rendered_config_is_valid_for_haproxy() -> None:
    cfg = render("loadbalancer", "haproxy.cfg.j2", groups={"inference_nodes": ["n2", "n3"]},
                 hostvars={"n2": {"ansible_host": "10.0.0.2"}, "n3": {"ansible_host": "10.0.0.3"}})
    assert "server n2 10.0.0.2:8000" in cfg and "server n3 10.0.0.3:8000" in cfg
    assert "timeout server 300s" in cfg  # streamed completions outlive HTTP's usual timeouts
    assert "bind *:8404" in cfg and "prometheus-exporter" in cfg


def test_a_draining_backend_503_is_retried_on_the_other(lb: dict) -> None:
    lb["a"].post = 503  # a draining inference service answers 503 before doing any work
    codes = Counter(post(lb["url"])[0] for _ in range(20))
    assert codes == Counter({200: 20})
    assert lb["b"].hits[200] == 20 and lb["a"].hits[503] > 0  # a was tried, b answered


def test_a_failing_health_check_takes_the_server_out(lb: dict) -> None:
    lb["a"].health = 503
    wait_up(lb["stats"], {"b"})
    before = lb["a"].hits.total()
    assert all(post(lb["url"])[0] == 200 for _ in range(10))
    assert lb["a"].hits.total() == before  # no request reached the server that is out
    lb["a"].health = 200
    wait_up(lb["stats"], {"a", "b"})


def test_a_stopped_backend_is_retried_on_the_other(lb: dict) -> None:
    lb["a"].shutdown()
    lb["a"].server_close()  # connection refused from now on, before any health check notices
    assert Counter(post(lb["url"])[0] for _ in range(10)) == Counter({200: 10})


def test_rate_limit_answers_429_with_retry_after(lb: dict) -> None:
    results = [post(lb["url"]) for _ in range(50)]
    codes = [code for code, _, _ in results]
    assert codes[:40] == [200] * 40
    assert set(codes[41:]) == {429}
    _, body, headers = results[-1]
    assert body["error_type"] == "rate_limit_error" and headers.get("retry-after") == "1"


def _admin(sock: Path, line: str) -> str:
    """One runtime-API command on HAProxy's admin socket, as socat sends it for `shardstack node`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def _server_status(sock: Path, server: str) -> str:
    rows = [r.split(",") for r in _admin(sock, "show stat").splitlines() if r.startswith(f"inference,{server},")]
    return rows[0][17]


def test_cordon_commands_drain_and_restore_a_server(lb: dict, tmp_path: Path) -> None:
    from shardstack.errors import ShardstackError
    from shardstack.ops import cordon
    from shardstack.ops import status as status_ops
    from shardstack.ops.runner import CommandResult

    sock = tmp_path / "admin.sock"
    command = cordon.haproxy_command("inference", "a", "cordon")
    answer = _admin(sock, command)
    cordon.check_haproxy_answers({"lb": CommandResult("lb", 0, answer)}, ["lb"], command)  # empty: accepted
    assert _server_status(sock, "a") == "DRAIN"
    servers = {s["server"]: s for s in status_ops.haproxy_servers(lb["stats"])}  # what `shardstack status` reads
    assert servers["a"]["status"] == "DRAIN" and servers["b"]["status"] == "UP"
    before = lb["a"].hits[200]
    codes = Counter(post(lb["url"])[0] for _ in range(10))
    assert codes == Counter({200: 10}) and lb["a"].hits[200] == before  # no new requests reach a drained server

    _admin(sock, cordon.haproxy_command("inference", "a", "uncordon"))
    assert _server_status(sock, "a") == "UP"

    # A server HAProxy does not know: its answer is an error, reported with a hint.
    bad = cordon.haproxy_command("inference", "nosuch", "drain")
    answer = _admin(sock, bad)
    assert answer.strip()
    with pytest.raises(ShardstackError, match="HAProxy refused"):
        cordon.check_haproxy_answers({"lb": CommandResult("lb", 0, answer)}, ["lb"], bad)
