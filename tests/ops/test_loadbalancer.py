"""The load balancer's haproxy.cfg, rendered from the role and run by the real HAProxy on loopback in front of
two small HTTP backends, with a certificate issued by the role's own module: HTTPS only (TLS 1.2+, HSTS, the plain
port a 301), active health checks, retries of 503/refused requests on the other server, per-server connection
limits with queueing, the per-client rate limit, HAProxy's own 429/503 in the inference service's error shape,
X-Forwarded-For, the stats page behind a password and /metrics on a listener of its own. The clients are
`shardstack.ops.endpoint`'s, trusting the cluster CA."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_vars import RoleEval
from journal_socket import JournalSocket
from shardstack.errors import ShardstackError
from shardstack.ops.endpoint import Endpoint, complete
from shardstack.ops.runner import run_playbook
from shardstack.serve.accesslog import REQUEST_ID_PATTERN
from shardstack.serve.apierror import ApiError

from .conftest import REPO, issue, render, role_value, store_files

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
STATS_PASSWORD = "stats-pass-for-tests"
# What the inference service itself would answer (docs/serving.md, "Errors"): HAProxy's own bodies must be these.
RATE_LIMITED = ApiError(429, "rate limit exceeded; retry later", code="rate_limit_exceeded")
UNAVAILABLE = ApiError(503, "no inference replica is available; retry later", code="unavailable")
NOT_AT_THE_EDGE = ApiError(404, "no such path at the load balancer: its API is /v1/* and /info", code="not_found")
TOO_LARGE = ApiError(413, "request body too large", code="payload_too_large")
TOO_MANY_CONNECTIONS = ApiError(429, "too many concurrent connections from this client; retry later",
                                code="rate_limit_exceeded")
GATE_CEILING = 120.0  # s: the most a gated backend holds a request, or a test waits for a state, on a loaded host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend(http.server.ThreadingHTTPServer):
    """/health answers `health`; POST answers `post` with the backend's name (503 = draining; 0 = the backend dies
    running it: the connection closes with no answer), when `gate` is set only once the test sets that event.
    `in_flight`/`max_in_flight` count the POSTs being answered."""

    def __init__(self, addr: str, port: int, name: str, store: Path) -> None:
        self.name, self.health, self.post, self.hits = name, 200, 200, Counter()
        self.gate: threading.Event | None = None
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.forwarded: list[str | None] = []
        self.request_ids: list[str | None] = []
        self.seen: list[tuple[str | None, str | None]] = []  # (Authorization, X-Shardstack-Client) of each POST
        super().__init__((addr, port), _Handler)
        # HTTPS with a certificate of the cluster CA in `store`, for its inventory name, as the role issues it. The
        # handshake happens in the handler's thread, not in the accepting one.
        files = issue(store, name, [name, addr])
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(files["cert"], files["key"])
        self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
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
        self.server.forwarded.append(self.headers.get("X-Forwarded-For"))
        self.server.request_ids.extend(self.headers.get_all("X-Request-ID") or [None])
        self.server.seen.append((self.headers.get("Authorization"), self.headers.get("X-Shardstack-Client")))
        if self.server.post == 0:
            self.server.hits[0] += 1
            self.close_connection = True
            return
        with self.server.lock:
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            if self.server.gate is not None:
                self.server.gate.wait(GATE_CEILING)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1
        self.server.hits[self.server.post] += 1
        self._send(self.server.post, {"backend": self.server.name, "choices": [{"text": self.server.name}]})

    def log_message(self, *args: object) -> None:
        pass


def stats_crypt(password: str) -> str:
    """The hash the role's credentials task puts in HAProxy's userlist (openssl passwd -6)."""
    return subprocess.run(["openssl", "passwd", "-6", "-salt", "0123456789abcdef", "-stdin"], input=password,
                          capture_output=True, text=True, check=True).stdout.strip()


def wait_up(metrics: str, servers: set[str], timeout: float = 60) -> None:
    deadline, up = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(metrics, timeout=2).read().decode()
        except OSError:
            text = ""
        up = {line.split('server="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("haproxy_server_status{") and 'state="UP"} 1' in line}
        if up == servers:
            return
        time.sleep(0.2)
    raise AssertionError(f"servers UP in HAProxy: {up}, wanted {servers}")


@contextlib.contextmanager
def running_haproxy(tmp_path: Path, files: dict[str, Path], backends: dict[str, str], backend_port: int,
                    stats_password: str = STATS_PASSWORD, master_worker: bool = False,
                    **overrides: object) -> Iterator[dict]:
    """HAProxy with the role's configuration on 127.0.0.1, serving `files`' certificate; yields its addresses."""
    if not Path(HAPROXY).exists():
        pytest.fail("haproxy not found: apt-get install haproxy (the loadbalancer role's package)")
    ports = {"loadbalancer_port": free_port(), "loadbalancer_tls_port": free_port(),
             "loadbalancer_stats_port": free_port(), "loadbalancer_metrics_port": free_port()}
    ports.update({k: overrides.pop(k) for k in list(overrides) if k in ports})
    pem = tmp_path / "lb.pem"
    pem.write_text(files["cert"].read_text() + files["key"].read_text())
    pem.chmod(0o600)
    journal = JournalSocket(tmp_path / "journal.sock")  # journald's native socket, for the access log
    variables = {"loadbalancer_access_log_socket": str(journal.path),
                 "inventory_hostname": "lb", "groups": {"inference_nodes": sorted(backends)},
                 "hostvars": {name: {"ansible_host": addr} for name, addr in backends.items()},
                 "loadbalancer_bind": "127.0.0.1", "loadbalancer_stats_bind": "127.0.0.1",
                 "loadbalancer_tls_pem": str(pem), "loadbalancer_backend_port": backend_port,
                 "loadbalancer_admin_socket": str(tmp_path / "admin.sock"), "loadbalancer_health_interval_ms": 200,
                 "__loadbalancer_stats_crypt": {"stdout": stats_crypt(stats_password)},
                 "__loadbalancer_backend_ca": str(files["ca_cert"]), **ports, **overrides}
    cfg = render("loadbalancer", "haproxy.cfg.j2", **variables)
    # Not as a daemon, not chrooted, not switching users: the test's own process tree, cleaned up below.
    local_only = ("daemon", "chroot /var/lib/haproxy", "user haproxy", "group haproxy")
    cfg = "\n".join(line for line in cfg.splitlines() if line.strip() not in local_only) + "\n"
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg)
    check = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # Master-worker (-W), as haproxy.service runs it, where a test reloads it (SIGUSR2 to the master).
    proc = subprocess.Popen([HAPROXY, *(["-W"] if master_worker else []), "-db", "-f", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lb = {"https": f"https://127.0.0.1:{ports['loadbalancer_tls_port']}",
          "http": ("127.0.0.1", ports["loadbalancer_port"]),
          "stats": f"https://127.0.0.1:{ports['loadbalancer_stats_port']}/stats",
          "metrics": f"http://127.0.0.1:{ports['loadbalancer_metrics_port']}/metrics",
          "ports": ports, "cfg": cfg, "journal": journal, "proc": proc}
    try:
        yield lb
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        journal.close()


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[dict]:
    files = issue(tmp_path / "credentials", "lb", ["lb", "127.0.0.1"])
    backend_port = free_port()
    store = tmp_path / "credentials"
    a, b = Backend("127.0.0.2", backend_port, "a", store), Backend("127.0.0.3", backend_port, "b", store)
    try:
        with running_haproxy(tmp_path, files, {"a": "127.0.0.2", "b": "127.0.0.3"}, backend_port,
                             loadbalancer_rate_limit_requests=40) as running:
            wait_up(running["metrics"], {"a", "b"})
            yield {**running, "a": a, "b": b, "ep": Endpoint(running["https"], None, files["ca_cert"]),
                   "files": files}
    finally:
        for server in (a, b):
            server.shutdown()
            server.server_close()


def post(lb: dict, headers: dict[str, str] | None = None,
         data: bytes = b'{"prompt": "x"}') -> tuple[int, bytes, dict[str, str]]:
    """POST /v1/completions over HTTPS, trusting the cluster CA: (status, raw body, lower-cased headers)."""
    req = urllib.request.Request(f"{lb['https']}/v1/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10, context=lb["ep"].tls) as resp:
            return resp.status, resp.read(), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()}


def hardening_dropin(**variables: Any) -> str:
    """haproxy's sandboxing drop-in, as shardstack_common's hardening.yml renders it from __loadbalancer_hardening."""
    return RoleEval("loadbalancer", {}, **variables).render_hardening("__loadbalancer_hardening", "haproxy")


def test_rendered_config_is_valid_for_haproxy() -> None:
    cfg = render("loadbalancer", "haproxy.cfg.j2", inventory_hostname="lb", ansible_host="10.0.0.1",
                 groups={"inference_nodes": ["n2", "n3"]},
                 hostvars={"n2": {"ansible_host": "10.0.0.2"}, "n3": {"ansible_host": "10.0.0.3"}},
                 __loadbalancer_stats_crypt={"stdout": "$6$x$y"})
    assert "timeout server 300s" in cfg  # streamed completions outlive HTTP's usual timeouts
    assert "bind *:443 ssl crt /etc/haproxy/certs/shardstack.pem" in cfg and "bind *:80\n" in cfg
    assert "ssl-min-ver TLSv1.2" in cfg
    # Stats and metrics on the node's cluster address only, never on the clients' wildcard bind.
    assert "bind 10.0.0.1:8404 ssl crt" in cfg and "bind 10.0.0.1:8405\n" in cfg
    assert "option forwardfor" in cfg
    # The access log: journal fields by default (the drop-in binds the socket into the chroot), or syslog, or off.
    assert cfg.count("log /run/systemd/journal/socket len 8192 format raw") == 2
    dropin = hardening_dropin()
    assert "BindReadOnlyPaths=/run/systemd/journal/socket:/var/lib/haproxy/run/systemd/journal/socket" in dropin
    for mode, no_log in (("syslog", 0), ("off", 2)):
        other = render("loadbalancer", "haproxy.cfg.j2", loadbalancer_access_log=mode, inventory_hostname="lb",
                       groups={"inference_nodes": ["n2"]}, hostvars={"n2": {"ansible_host": "10.0.0.2"}},
                       __loadbalancer_stats_crypt={"stdout": "$6$x$y"})
        assert "journal" not in other and other.count("    no log\n") == no_log
        assert "BindReadOnlyPaths" not in hardening_dropin(loadbalancer_access_log=mode)


def test_each_server_gets_what_its_service_admits_unless_set() -> None:
    service = yaml.safe_load((REPO / "roles/inference_service/defaults/main.yml").read_text())
    admits = service["inference_service_max_concurrency"] + service["inference_service_max_queue"]
    hostvars = {"n2": {"ansible_host": "10.0.0.2"},
                "n3": {"ansible_host": "10.0.0.3", "inference_service_max_concurrency": 4,
                       "inference_service_max_queue": 6, "inference_service_bind": "10.1.0.3"}}
    common = {"inventory_hostname": "lb", "groups": {"inference_nodes": ["n2", "n3"]}, "hostvars": hostvars,
              "__loadbalancer_stats_crypt": {"stdout": "$6$x$y"}, "loadbalancer_stats_bind": "10.0.0.1"}
    cfg = render("loadbalancer", "haproxy.cfg.j2", **common)
    # The service's defaults where the inventory sets nothing, the inventory's limits and address where it does.
    tls = " ssl verify required ca-file /etc/haproxy/cluster-ca.crt verifyhost"  # HTTPS, for the inventory name
    assert f"server n2 10.0.0.2:8000 maxconn {admits}{tls} n2\n" in cfg
    assert f"server n3 10.1.0.3:8000 maxconn 10{tls} n3\n" in cfg
    cfg = render("loadbalancer", "haproxy.cfg.j2", loadbalancer_server_maxconn=3, **common)
    assert f"server n2 10.0.0.2:8000 maxconn 3{tls} n2\n" in cfg
    assert f"server n3 10.1.0.3:8000 maxconn 3{tls} n3\n" in cfg


def test_prometheus_scrapes_the_metrics_listener_not_the_stats_page() -> None:
    lb = yaml.safe_load((REPO / "roles/loadbalancer/defaults/main.yml").read_text())
    prom = yaml.safe_load((REPO / "roles/prometheus/defaults/main.yml").read_text())
    job = next(j for j in prom["prometheus_scrape_jobs"] if j["name"] == "loadbalancer")
    assert job["port"] == lb["loadbalancer_metrics_port"] != lb["loadbalancer_stats_port"]


def test_a_completion_over_https_with_the_cluster_ca(lb: dict) -> None:
    answers = [complete(lb["ep"], "x") for _ in range(4)]
    assert [a.status for a in answers] == [200] * 4
    assert {a.text for a in answers} == {"a", "b"}  # both backends serve


def test_the_plain_port_only_redirects_to_https(lb: dict) -> None:
    host, port = lb["http"]
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("POST", "/v1/completions?x=1", body=b"{}", headers={"Host": f"lb.example:{port}"})
    resp = conn.getresponse()
    tls_port = lb["ports"]["loadbalancer_tls_port"]
    assert resp.status == 301 and resp.getheader("Location") == f"https://lb.example:{tls_port}/v1/completions?x=1"
    assert lb["a"].hits.total() + lb["b"].hits.total() == 0  # nothing reached a backend in clear


def test_tls_1_2_at_least_and_hsts(lb: dict) -> None:
    old = ssl.create_default_context(cafile=str(lb["files"]["ca_cert"]))
    old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    with pytest.warns(DeprecationWarning):  # which is the point
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # the client offers TLS 1.1 for real; the server must refuse it
    address = ("127.0.0.1", lb["ports"]["loadbalancer_tls_port"])
    with pytest.raises(ssl.SSLError), socket.create_connection(address) as s:
        old.wrap_socket(s, server_hostname="127.0.0.1")
    with socket.create_connection(address) as s, \
            lb["ep"].tls.wrap_socket(s, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    status, _, headers = post(lb)
    assert status == 200 and headers["strict-transport-security"] == "max-age=63072000"


def test_a_client_that_does_not_trust_the_certificate_gets_one_clear_line(lb: dict, tmp_path: Path) -> None:
    other = issue(tmp_path / "other", "lb", ["lb", "127.0.0.1"])  # another cluster's CA
    with pytest.raises(ShardstackError) as err:
        complete(dataclasses.replace(lb["ep"], cafile=other["ca_cert"]), "x")
    assert str(err.value).startswith(f"TLS: {lb['https']} presented a certificate the CA in {other['ca_cert']} "
                                     "does not accept: unable to get local issuer certificate")
    assert "Traceback" not in str(err.value) and len(str(err.value).splitlines()) == 2  # the line and its hint
    with pytest.raises(ShardstackError, match="no CA certificate at"):
        complete(dataclasses.replace(lb["ep"], cafile=tmp_path / "missing.crt"), "x")


def test_backends_see_the_clients_address_and_only_that(lb: dict) -> None:
    assert post(lb, {"X-Forwarded-For": "6.6.6.6"})[0] == 200
    forwarded = lb["a"].forwarded + lb["b"].forwarded
    assert forwarded == ["127.0.0.1"]


def test_the_access_log_is_journal_fields_without_secrets(lb: dict) -> None:
    """One datagram per request in journald's native protocol: HAPROXY_* fields, the request id the backend got as
    X-Request-ID (the inference service's SHARDSTACK_REQUEST_ID), never the Authorization header or query string."""
    token = "bearer-secret-for-the-log-test"
    req = urllib.request.Request(f"{lb['https']}/v1/completions?api_key=query-secret", data=b'{"prompt": "x"}',
                                 method="POST", headers={"Content-Type": "application/json", "X-Request-ID": "forged",
                                                         "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10, context=lb["ep"].tls) as resp:
        assert resp.status == 200
        body = resp.read()
    e = lb["journal"].entry("HAPROXY_PATH", "/v1/completions")
    server = json.loads(body)["backend"]
    assert {k: e[k] for k in ("HAPROXY_FRONTEND", "HAPROXY_BACKEND", "HAPROXY_SERVER", "HAPROXY_STATUS",
                              "HAPROXY_METHOD", "HAPROXY_CLIENT", "SYSLOG_IDENTIFIER", "PRIORITY")} == {
        "HAPROXY_FRONTEND": "inference", "HAPROXY_BACKEND": "inference", "HAPROXY_SERVER": server,
        "HAPROXY_STATUS": "200", "HAPROXY_METHOD": "POST", "HAPROXY_CLIENT": "127.0.0.1",
        "SYSLOG_IDENTIFIER": "haproxy", "PRIORITY": "6"}
    assert int(e["HAPROXY_BYTES"]) >= len(body) and int(e["HAPROXY_TT"]) >= int(e["HAPROXY_TA"]) >= 0
    assert all(int(e[k]) >= 0 for k in ("HAPROXY_TR", "HAPROXY_TW", "HAPROXY_TC", "HAPROXY_TRESP", "HAPROXY_RETRIES"))
    assert e["HAPROXY_TERMINATION"] == "----"
    assert f" inference inference/{server} " in e["MESSAGE"] and e["MESSAGE"].endswith(" POST /v1/completions HTTP/1.1")
    # HAProxy's own id reached the backend, once; the client's was dropped.
    assert lb["a"].request_ids + lb["b"].request_ids == [e["HAPROXY_REQUEST_ID"]] != ["forged"]
    assert REQUEST_ID_PATTERN.fullmatch(e["HAPROXY_REQUEST_ID"])  # the service logs it as SHARDSTACK_REQUEST_ID
    # The redirect frontend logs the same way; a probe of the stats or metrics listener does not.
    host, port = lb["http"]
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert conn.getresponse().status == 301
    e = lb["journal"].entry("HAPROXY_FRONTEND", "http_redirect")
    assert e["HAPROXY_STATUS"] == "301" and e["HAPROXY_SERVER"] == "<NOSRV>"
    urllib.request.urlopen(lb["metrics"], timeout=5).read()
    time.sleep(0.3)
    assert {f["HAPROXY_FRONTEND"] for f in lb["journal"].entries()} <= {"inference", "http_redirect"}
    everything = b"".join(lb["journal"].raw)
    for secret in (token, "query-secret", "Bearer", "authorization", "forged"):
        assert secret.encode().lower() not in everything.lower(), secret


def test_a_draining_backend_503_is_retried_on_the_other(lb: dict) -> None:
    lb["a"].post = 503  # a draining inference service answers 503 before doing any work
    codes = Counter(post(lb)[0] for _ in range(20))
    assert codes == Counter({200: 20})
    assert lb["b"].hits[200] == 20 and lb["a"].hits[503] > 0  # a was tried, b answered


def test_a_request_that_kills_its_backend_is_not_replayed_on_another(lb: dict) -> None:
    lb["a"].post = lb["b"].post = 0  # whichever server gets it dies running it
    status, body, headers = post(lb)
    assert status == 502 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "bad_gateway"  # OpenAI's error shape, not HAProxy's HTML page
    assert lb["a"].hits[0] + lb["b"].hits[0] == 1  # one server saw it; the other never did


def test_only_the_authenticated_api_is_served_at_the_edge(lb: dict) -> None:
    for path in ("/health", "/metrics", "/", "/stats"):
        status, body = lb["ep"].call("GET", path, timeout=10)
        assert (status, body) == (404, NOT_AT_THE_EDGE.json()), path
    assert lb["ep"].call("GET", "/info", timeout=10)[0] == 200  # the backends' own token check guards it
    assert post(lb)[0] == 200


def test_a_failing_health_check_takes_the_server_out(lb: dict) -> None:
    lb["a"].health = 503
    wait_up(lb["metrics"], {"b"})
    before = lb["a"].hits.total()
    assert all(post(lb)[0] == 200 for _ in range(10))
    assert lb["a"].hits.total() == before  # no request reached the server that is out
    lb["a"].health = 200
    wait_up(lb["metrics"], {"a", "b"})


def test_a_stopped_backend_is_retried_on_the_other(lb: dict) -> None:
    lb["a"].shutdown()
    lb["a"].server_close()  # connection refused from now on, before any health check notices
    assert Counter(post(lb)[0] for _ in range(10)) == Counter({200: 10})


def test_no_backend_up_is_the_services_503_with_retry_after(lb: dict) -> None:
    lb["a"].health = lb["b"].health = 503
    wait_up(lb["metrics"], set())
    status, body, headers = post(lb)
    assert status == 503 and body == UNAVAILABLE.json()
    # rise (2) × interval (200 ms here), rounded up: when a recovered server takes requests again.
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"


def test_rate_limit_answers_the_services_429_with_retry_after(lb: dict) -> None:
    results = [post(lb) for _ in range(50)]
    codes = [code for code, _, _ in results]
    assert codes[:40] == [200] * 40
    assert set(codes[41:]) == {429}
    _, body, headers = results[-1]
    assert body == RATE_LIMITED.json() and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/json"


def test_stats_want_the_password_metrics_do_not(lb: dict) -> None:
    tls = lb["ep"].tls
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(lb["stats"], timeout=5, context=tls)
    assert denied.value.code == 401
    wrong = base64.b64encode(b"stats:guess").decode()
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(urllib.request.Request(lb["stats"], headers={"Authorization": f"Basic {wrong}"}),
                               timeout=5, context=tls)
    assert denied.value.code == 401
    good = base64.b64encode(f"stats:{STATS_PASSWORD}".encode()).decode()
    page = urllib.request.urlopen(urllib.request.Request(lb["stats"], headers={"Authorization": f"Basic {good}"}),
                                  timeout=5, context=tls)
    assert page.status == 200 and b"inference" in page.read()
    assert urllib.request.urlopen(lb["metrics"], timeout=5).status == 200
    with pytest.raises(urllib.error.HTTPError) as other:  # the unauthenticated listener serves /metrics only
        urllib.request.urlopen(lb["metrics"].replace("/metrics", "/stats"), timeout=5)
    assert other.value.code == 404


def _until(what: str, ready: Callable[[], bool], timeout: float = GATE_CEILING,
           answered: Sequence[Future] = ()) -> None:
    """Wait for `ready`; none of the `answered` requests may come back before it is (that one's answer is the
    failure's reason)."""
    deadline = time.monotonic() + timeout
    while not ready():
        early = [f.result() for f in answered if f.done()]
        assert not early, f"answered before {what}: {early}"
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def _metric(metrics: str, name: str) -> float:
    """The value of HAProxy's `name` sample for the inference backend."""
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(name + "{") and 'proxy="inference"' in x)
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("queue", ["60s", "1s"])
def test_requests_beyond_every_servers_maxconn_wait_in_haproxys_queue(tmp_path: Path, queue: str) -> None:
    """One slot per server, each held by its backend until the test lets go: a third concurrent request waits in
    HAProxy for the first free server (served when the queue may wait 60 s) or gets the service's 503 when
    `timeout queue` (1 s) runs out while both servers are still busy. Event-driven: the test waits for the
    servers' and HAProxy's state, not for requests to arrive within some window of each other."""
    files = issue(tmp_path / "credentials", "lb", ["127.0.0.1"])
    port = free_port()
    store = files["ca_cert"].parent
    a, b = Backend("127.0.0.2", port, "a", store), Backend("127.0.0.3", port, "b", store)
    a.gate = b.gate = gate = threading.Event()
    try:
        # The servers never go down here: on a loaded host a check slower than its 200 ms interval must not take
        # one out (a downed server would leave the second request queued too, and no server holding it).
        with running_haproxy(tmp_path, files, {"a": "127.0.0.2", "b": "127.0.0.3"}, port,
                             loadbalancer_server_maxconn=1, loadbalancer_timeout_queue=queue,
                             loadbalancer_health_fall=10_000) as running:
            wait_up(running["metrics"], {"a", "b"})
            ep = Endpoint(running["https"], None, files["ca_cert"])
            with ThreadPoolExecutor(3) as pool:
                try:
                    # One at a time, each sent once the one before is held: the third finds no server free
                    # whatever the order in which a loaded host would have delivered three sent together.
                    futures: list[Future] = []
                    for held in (1, 2):
                        futures.append(pool.submit(complete, ep, "x", timeout=GATE_CEILING))
                        _until(f"the servers hold {held} request(s)",
                               lambda held=held: a.in_flight + b.in_flight == held, answered=futures)
                    assert a.in_flight == b.in_flight == 1
                    futures.append(pool.submit(complete, ep, "x", timeout=GATE_CEILING))
                    if queue == "1s":
                        # Both servers still held, so the first answer can only be HAProxy's own, after the
                        # third request sat out `timeout queue` (a lower bound: load only makes it longer).
                        done, _ = wait(futures, timeout=GATE_CEILING, return_when=FIRST_COMPLETED)
                        assert done, "no answer while both servers were busy"
                        early = next(iter(done)).result()
                        assert early.status == 503 and early.seconds >= 1.0, early
                        assert a.in_flight == b.in_flight == 1 and a.hits.total() == b.hits.total() == 0
                    else:
                        _until("the third request queued in HAProxy",
                               lambda: _metric(running["metrics"], "haproxy_backend_current_queue") == 1)
                    assert _metric(running["metrics"], "haproxy_backend_max_queue") == 1  # queued, not refused
                finally:
                    gate.set()  # also on failure: never leave the pool's threads waiting on held requests
                answers = [f.result() for f in futures]
    finally:
        for server in (a, b):
            server.shutdown()
            server.server_close()
    codes = sorted(c.status for c in answers)
    assert max(a.max_in_flight, b.max_in_flight) == 1  # HAProxy never sent a server more than its maxconn
    assert max(a.hits.total(), b.hits.total()) <= (2 if queue == "60s" else 1)
    if queue == "60s":
        assert codes == [200, 200, 200]  # the queued one was served by the first server to free up
    else:
        assert codes == [200, 200, 503]
        assert next(c.body for c in answers if c.status == 503) == json.loads(UNAVAILABLE.json())


@contextlib.contextmanager
def _two_backends(tmp_path: Path, **overrides: object) -> Iterator[dict]:
    """HAProxy with the role's configuration (and `overrides`) in front of backends a and b, both UP."""
    files = issue(tmp_path / "credentials", "lb", ["127.0.0.1"])
    port = free_port()
    store = files["ca_cert"].parent
    a, b = Backend("127.0.0.2", port, "a", store), Backend("127.0.0.3", port, "b", store)
    try:
        with running_haproxy(tmp_path, files, {"a": "127.0.0.2", "b": "127.0.0.3"}, port, **overrides) as running:
            wait_up(running["metrics"], {"a", "b"})
            yield {**running, "a": a, "b": b, "ep": Endpoint(running["https"], None, files["ca_cert"]),
                   "files": files}
    finally:
        for server in (a, b):
            server.shutdown()
            server.server_close()


def test_a_body_announced_over_the_edge_limit_gets_413_and_reaches_no_backend(tmp_path: Path) -> None:
    with _two_backends(tmp_path, loadbalancer_max_body_bytes=1024) as lb:
        status, body, headers = post(lb, data=b" " * 1025)
        assert (status, body, headers["content-type"]) == (413, TOO_LARGE.json(), "application/json")
        assert lb["a"].hits.total() + lb["b"].hits.total() == 0
        assert post(lb, data=b'{"prompt": "x"}'.ljust(1024))[0] == 200  # at the limit: passed on


def test_a_client_over_its_connection_limit_gets_429_while_its_held_requests_are_served(tmp_path: Path) -> None:
    """Two connections held open by requests the backends do not answer yet: a third connection from the same
    address gets HAProxy's 429 without reaching a backend; once the held ones finish the client is served again."""
    with _two_backends(tmp_path, loadbalancer_client_max_connections=2) as lb:
        a, b = lb["a"], lb["b"]
        a.gate = b.gate = gate = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            try:
                held = [pool.submit(complete, lb["ep"], "x", timeout=GATE_CEILING) for _ in range(2)]
                _until("two requests held by the backends", lambda: a.in_flight + b.in_flight == 2, answered=held)
                status, body, headers = post(lb)
                assert (status, body, headers["retry-after"]) == (429, TOO_MANY_CONNECTIONS.json(), "1")
                assert a.in_flight + b.in_flight == 2 and a.hits.total() + b.hits.total() == 0
            finally:
                gate.set()
            assert [f.result().status for f in held] == [200, 200]
        # The limit counts open connections: with the held ones closed, the next request is served.
        _until("a request served after the held ones closed", lambda: post(lb)[0] == 200)


CLUSTER_TOKEN = "cluster-token-of-the-backends"
KEYS = {"team-a": "key-of-team-a", "team-b": "key-of-team-b", "team-c": "key-of-team-c"}
UNAUTHORIZED = ApiError(401, "missing or invalid API key", code="invalid_api_key")
KEY_RATE = ApiError(429, "rate limit of this API key exceeded; retry later", code="rate_limit_exceeded")
KEY_CONCURRENCY = ApiError(429, "too many requests in flight with this API key; retry later",
                           code="rate_limit_exceeded")


def _write_key_maps(api_dir: Path, keys: dict[str, str], api_keys: list[dict]) -> None:
    """The maps configure.yml writes, from the role's own expressions, for these keys and the cluster token."""
    hashes = {"cluster": hashlib.sha256(CLUSTER_TOKEN.encode()).hexdigest()}
    hashes.update({name: hashlib.sha256(key.encode()).hexdigest() for name, key in keys.items()})
    maps = role_value("loadbalancer", "__loadbalancer_api_maps", loadbalancer_api_keys=api_keys,
                      __loadbalancer_api_key_hashes=hashes)
    api_dir.mkdir(mode=0o700, exist_ok=True)
    for name, text in maps.items():
        (api_dir / name).write_text(text)
    (api_dir / "backend-token.map").write_text(f"token {CLUSTER_TOKEN}\n")


@contextlib.contextmanager
def _keyed(tmp_path: Path, **overrides: object) -> Iterator[dict]:
    """The edge with named keys: team-a at 5 requests per period, team-b 1 in flight, team-c the defaults; the cluster
    token as "cluster"."""
    api_keys = [{"name": "team-a", "requests": 5}, {"name": "team-b", "concurrency": 1}, {"name": "team-c"}]
    _write_key_maps(tmp_path / "api", KEYS, api_keys)
    with _two_backends(tmp_path, loadbalancer_api_keys=api_keys, __loadbalancer_api_dir=str(tmp_path / "api"),
                       **overrides) as lb:
        yield {**lb, "api_keys": api_keys}


def _as(lb: dict, key: str | None) -> Endpoint:
    return Endpoint(lb["https"], key, lb["ep"].cafile) if key else lb["ep"]


def test_only_named_keys_pass_and_backends_get_the_cluster_token_and_the_name(tmp_path: Path) -> None:
    with _keyed(tmp_path) as lb:
        for key in (None, "not-a-key", KEYS["team-a"][:-1]):
            status, body = _as(lb, key).call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)
            assert (status, body) == (401, UNAUTHORIZED.json()), key
        assert lb["a"].seen + lb["b"].seen == []  # refused at the edge
        forged = {"Authorization": f"Bearer {KEYS['team-a']}", "X-Shardstack-Client": "cluster"}
        assert post(lb, forged)[0] == 200
        assert _as(lb, CLUSTER_TOKEN).call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0] == 200
        # The cluster token and the key's name, whatever the client wrote; never a client's key.
        assert sorted(lb["a"].seen + lb["b"].seen) == [(f"Bearer {CLUSTER_TOKEN}", "cluster"),
                                                       (f"Bearer {CLUSTER_TOKEN}", "team-a")]
        entry = lb["journal"].entry("HAPROXY_API_KEY", "team-a")
        assert entry["HAPROXY_STATUS"] == "200"
        everything = b"".join(lb["journal"].raw)
        assert not any(k.encode() in everything for k in (*KEYS.values(), CLUSTER_TOKEN))


def test_a_key_over_its_rate_gets_429_while_another_key_is_served(tmp_path: Path) -> None:
    with _keyed(tmp_path) as lb:
        a, b = _as(lb, KEYS["team-a"]), _as(lb, KEYS["team-b"])
        codes = [a.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10) for _ in range(7)]
        assert [c for c, _ in codes[:5]] == [200] * 5 and codes[-1] == (429, KEY_RATE.json())
        assert [b.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0] for _ in range(6)] == [200] * 6


def test_a_key_over_its_concurrency_gets_429_while_another_key_is_served(tmp_path: Path) -> None:
    with _keyed(tmp_path) as lb:
        a, b = _as(lb, KEYS["team-a"]), _as(lb, KEYS["team-b"])
        lb["a"].gate = lb["b"].gate = gate = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            try:
                held = pool.submit(b.call, "POST", "/v1/completions", {"prompt": "x"}, timeout=GATE_CEILING)
                _until("team-b's request held", lambda: lb["a"].in_flight + lb["b"].in_flight == 1)
                assert b.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10) == (429, KEY_CONCURRENCY.json())
                other = pool.submit(a.call, "POST", "/v1/completions", {"prompt": "x"}, timeout=GATE_CEILING)
                _until("team-a's request reached a backend", lambda: lb["a"].in_flight + lb["b"].in_flight == 2)
            finally:
                gate.set()
            assert held.result()[0] == other.result()[0] == 200
        _until("team-b served again once its request ended",
               lambda: b.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0] == 200)


def test_revoking_a_key_is_one_reload_and_fails_no_request_of_another(tmp_path: Path) -> None:
    """team-a removed from the maps, HAProxy reloaded as systemd reloads it (SIGUSR2 to the master) while team-c
    sends requests one after another: team-a gets 401 from then on, team-c no error. (team-c has no in-flight limit
    of its own: with team-b's limit of 1, a client opening a new connection per request can arrive before HAProxy
    has released the previous one, a 429 unrelated to the reload.)"""
    with _keyed(tmp_path, master_worker=True, loadbalancer_rate_limit_requests=10_000) as lb:
        a, c = _as(lb, KEYS["team-a"]), _as(lb, KEYS["team-c"])
        assert a.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0] == 200
        codes: Counter = Counter()
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                try:
                    codes[c.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0]] += 1
                except OSError as exc:
                    codes[type(exc).__name__] += 1

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        try:
            _until("team-c's load running", lambda: codes[200] >= 5)
            _write_key_maps(tmp_path / "api", {k: KEYS[k] for k in ("team-b", "team-c")}, lb["api_keys"][1:])
            lb["proc"].send_signal(signal.SIGUSR2)
            _until("team-a revoked", lambda: a.call("POST", "/v1/completions", {"prompt": "x"}, timeout=10)[0] == 401)
            served = codes[200]
            _until("team-c's load after the reload", lambda: codes[200] >= served + 5)
        finally:
            done.set()
            worker.join(timeout=30)
        assert set(codes) == {200}, dict(codes)


def test_validate_probes_over_https_and_no_secret_reaches_the_runner_artifacts(tmp_path: Path) -> None:
    """The role's credentials tasks and validate.yml's inference checks, run for real through ansible-runner
    against this machine, then every artifact file searched for the token, the stats password and both keys."""
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir()
    port, tls_port = free_port(), free_port()
    inv.write_text(yaml.safe_dump({"all": {
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "loadbalancer_tls_port": tls_port},
        "children": {"train_nodes": {}, "storage_server": {}, "monitoring_server": {},
                     "inference_nodes": {"hosts": {"a": {"ansible_host": "127.0.0.2"},
                                                   "b": {"ansible_host": "127.0.0.3"}}},
                     "loadbalancer": {"hosts": {"lb": {"ansible_host": "127.0.0.1"}}}}}}))
    store = inv.parent / "credentials"  # the roles' default stores, beside the inventory
    store.mkdir()
    token = "tok-" + base64.b32encode(os.urandom(15)).decode()
    (store / "inference-token.txt").write_text(token + "\n")
    art = tmp_path / "artifacts"

    creds = run_playbook("tests/ops/playbooks/edge_credentials.yml", inv, artifacts=art)
    assert creds.success, {h: (r.failed_task, r.message) for h, r in creds.hosts.items()}
    files = store_files(store, "lb")
    password = (store / "loadbalancer-stats.txt").read_text().strip()
    a, b = Backend("127.0.0.2", port, "a", store), Backend("127.0.0.3", port, "b", store)
    try:
        with running_haproxy(tmp_path, files, {"a": "127.0.0.2", "b": "127.0.0.3"}, port, stats_password=password,
                             loadbalancer_tls_port=tls_port) as running:
            wait_up(running["metrics"], {"a", "b"})
            val = run_playbook("playbooks/validate.yml", inv, tags="validate_inference",
                               extravars={"validate_inference_port": port,
                                          "validate_backend_ca": str(files["ca_cert"])}, artifacts=art)
    finally:
        for server in (a, b):
            server.shutdown()
            server.server_close()
    assert val.success, {h: (r.failed_task, r.message) for h, r in val.hosts.items()}
    probe = val.data["validate_inference"]
    assert probe["url"] == f"https://127.0.0.1:{tls_port}" and int(probe["status"]) == 200, probe
    assert probe["backends"] == {"a": 200, "b": 200}

    keys = [line for f in ("ca_key", "key") for line in files[f].read_text().splitlines() if "-----" not in line]
    secrets = {"token": token, "stats password": password, **{f"key line {i}": k for i, k in enumerate(keys)}}
    texts = {p: p.read_text(errors="replace") for p in art.rglob("*") if p.is_file()}
    assert any("A completion through the load balancer" in t for t in texts.values())  # the events are there
    leaks = {name: sorted(str(p.relative_to(art)) for p, t in texts.items() if value in t)
             for name, value in secrets.items()}
    assert not any(leaks.values()), leaks


def test_named_keys_are_hashed_on_the_controller_and_generated_once(tmp_path: Path) -> None:
    """credentials.yml for real: the maps hold the SHA-256 of a given key, of a generated one (made once in the
    store, the same on the next run) and of the cluster token; no key reaches the runner's artifacts."""
    keys = [{"name": "given", "key": KEYS["team-a"], "requests": 7}, {"name": "made", "concurrency": 2}]
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir()
    inv.write_text(yaml.safe_dump({"all": {  # the keys in the inventory, where a deployment keeps them (or a vault)
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "loadbalancer_api_keys": keys},
        "children": {"inference_nodes": {"hosts": {"a": {"ansible_host": "127.0.0.2"}}},
                     "loadbalancer": {"hosts": {"lb": {"ansible_host": "127.0.0.1"}}}}}}))
    store = inv.parent / "credentials"
    store.mkdir()
    (store / "inference-token.txt").write_text(CLUSTER_TOKEN + "\n")
    runs = [run_playbook("tests/ops/playbooks/edge_credentials.yml", inv, artifacts=tmp_path / f"art{i}")
            for i in range(2)]
    assert all(r.success for r in runs), [{h: (x.failed_task, x.message) for h, x in r.hosts.items()} for r in runs]
    made = (store / "api-key-made.txt").read_text().strip()
    assert len(made) == 48 and made.isalnum()
    sha = {name: hashlib.sha256(k.encode()).hexdigest()
           for name, k in (("cluster", CLUSTER_TOKEN), ("given", KEYS["team-a"]), ("made", made))}
    maps = runs[0].data["api_maps"]
    assert maps == runs[1].data["api_maps"]  # the generated key is kept
    assert maps["keys.map"] == "".join(f"{d} {n}\n" for n, d in sorted(sha.items()))
    assert maps["requests.map"] == "cluster 600\ngiven 7\nmade 600\n"
    assert maps["concurrency.map"] == "cluster 64\ngiven 64\nmade 2\n"
    texts = [p.read_text(errors="replace") for p in tmp_path.glob("art*/**/*") if p.is_file()]
    assert texts and not any(k in t for t in texts for k in (CLUSTER_TOKEN, KEYS["team-a"], made))


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
    from shardstack.ops import cordon
    from shardstack.ops import status as status_ops
    from shardstack.ops.runner import CommandResult

    sock = tmp_path / "admin.sock"
    command = cordon.haproxy_command("inference", "a", "cordon")
    answer = _admin(sock, command)
    cordon.check_haproxy_answers({"lb": CommandResult("lb", 0, answer)}, ["lb"], command)  # empty: accepted
    assert _server_status(sock, "a") == "DRAIN"
    servers = {s["server"]: s for s in status_ops.haproxy_servers(lb["metrics"])}  # what `shardstack status` reads
    assert servers["a"]["status"] == "DRAIN" and servers["b"]["status"] == "UP"
    before = lb["a"].hits[200]
    codes = Counter(post(lb)[0] for _ in range(10))
    assert codes == Counter({200: 10}) and lb["a"].hits[200] == before  # no new requests reach a drained server

    _admin(sock, cordon.haproxy_command("inference", "a", "uncordon"))
    assert _server_status(sock, "a") == "UP"
    assert {s["server"]: s["status"] for s in status_ops.haproxy_servers(lb["metrics"])} == {"a": "UP", "b": "UP"}

    # A server HAProxy does not know: its answer is an error, reported with a hint.
    bad = cordon.haproxy_command("inference", "nosuch", "drain")
    answer = _admin(sock, bad)
    assert answer.strip()
    with pytest.raises(ShardstackError, match="HAProxy refused"):
        cordon.check_haproxy_answers({"lb": CommandResult("lb", 0, answer)}, ["lb"], bad)
