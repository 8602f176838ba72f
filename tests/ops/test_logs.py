"""Central logs on this machine, with the real tools: journal files written by systemd-journal-remote read by the
collector's metrics and retention tool (roles/log_collector/files/log-collector.py) through journalctl; the native
journal protocol (shardstack.journal) against a datagram socket that parses it as journald does; the inference
service's access-log entry; HAProxy's JSON access log from the role's haproxy.cfg; `shardstack logs` parsing
journalctl's JSON and refusing bad arguments before it reaches any node."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from shardstack import journal
from shardstack.cli import main as cli_main
from shardstack.ops import logs as logs_ops

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "roles/log_collector/files/log-collector.py"
JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
BOOT = "4843c40333a84828883539765a1226aa"


def _tool():
    spec = importlib.util.spec_from_file_location("log_collector_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, entries: list[dict[str, str]]) -> None:
    """Journal entries into a journal file the way the collector gets them: systemd-journal-remote, export format."""
    if not Path(JOURNAL_REMOTE).exists() or not shutil.which("journalctl"):
        pytest.fail("systemd-journal-remote and journalctl are needed: apt-get install systemd-journal-remote "
                    "(make setup does)")
    export = b""
    for i, e in enumerate(entries):
        fields = {"_BOOT_ID": BOOT, "__MONOTONIC_TIMESTAMP": str(1000 + i), **e}
        export += b"".join(f"{k}={v}\n".encode() for k, v in fields.items()) + b"\n"
    proc = subprocess.run([JOURNAL_REMOTE, f"--output={path}", "-"], input=export, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def _entry(host: str, message: str, at: float) -> dict[str, str]:
    return {"__REALTIME_TIMESTAMP": str(int(at * 1e6)), "_HOSTNAME": host, "MESSAGE": message,
            "SYSLOG_IDENTIFIER": "test"}


def _metrics(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_arrival_metrics_count_each_node_after_its_own_cursor(tmp_path: Path) -> None:
    tool = _tool()
    store, state, prom = tmp_path / "remote", tmp_path / "state.json", tmp_path / "shardstack_logs.prom"
    store.mkdir()
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps({"10.0.0.2": "n2"}))
    now = time.time()
    # n2: an entry from last year (before the first look's window) and two recent ones; n3: one recent.
    _write(store / "remote-10.0.0.2.journal", [_entry("gpu02", "old", now - 365 * 86400),
                                               _entry("gpu02", "a", now - 60), _entry("gpu02", "b", now - 30)])
    _write(store / "remote-10.0.0.3.journal", [_entry("gpu03", "c", now - 10)])
    argv = ["--store", str(store), "metrics", "--textfile", str(prom), "--state", str(state),
            "--sources", str(sources), "--local-name", "mon"]
    assert tool.main(argv) == 0
    first = _metrics(prom.read_text())
    # The inventory name where the source is known, the node's own hostname where not.
    assert first['shardstack_logs_received_entries_total{host="n2",source="10.0.0.2"}'] == 2
    assert first['shardstack_logs_received_entries_total{host="gpu03",source="10.0.0.3"}'] == 1
    seen = first['shardstack_logs_last_received_timestamp_seconds{host="n2",source="10.0.0.2"}']
    assert now - 5 < seen < time.time() + 1
    assert first["shardstack_logs_store_bytes"] > 0 and first["shardstack_logs_store_limit_bytes"] > 0
    assert oct(state.stat().st_mode & 0o777) == "0o600"

    # n3 sends one more, stamped *earlier* than n2's newest (a late or slow-clocked node): still counted, because
    # each source is read after its own cursor.
    time.sleep(0.05)
    _write(store / "remote-10.0.0.3.journal", [_entry("gpu03", "late", now - 40)])
    assert tool.main(argv) == 0
    second = _metrics(prom.read_text())
    assert second['shardstack_logs_received_entries_total{host="gpu03",source="10.0.0.3"}'] == 2
    assert second['shardstack_logs_received_entries_total{host="n2",source="10.0.0.2"}'] == 2
    # Nothing new from n2: its arrival time stays; n3's moved.
    assert second['shardstack_logs_last_received_timestamp_seconds{host="n2",source="10.0.0.2"}'] == seen
    assert second['shardstack_logs_last_received_timestamp_seconds{host="gpu03",source="10.0.0.3"}'] > seen


def test_archived_files_belong_to_their_source() -> None:
    tool = _tool()
    for name, source in [("remote-10.0.0.2.journal", "10.0.0.2"),
                         ("remote-10.0.0.2@0123abcd-0000000000000001-0005f3a1b2c3d4e5.journal", "10.0.0.2"),
                         ("remote-gpu01.example.journal~", "gpu01.example")]:
        assert tool.FILE_RE.match(name).group("source") == source
    assert tool.FILE_RE.match("system.journal") is None


def test_vacuum_runs_journalctl_with_the_store_limit(tmp_path: Path) -> None:
    tool = _tool()
    store = tmp_path / "remote"
    store.mkdir()
    _write(store / "remote-10.0.0.2.journal", [_entry("gpu02", "x", time.time())])
    proc = subprocess.run([sys.executable, str(TOOL), "--store", str(store), "--disk-share", "40", "vacuum",
                           "--retention", "30day"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    limit = tool.store_limit(store, 40, 15)
    assert f"{store}: {tool.store_bytes(store)} bytes, limit" in proc.stdout
    assert 0 < limit <= os.statvfs(store).f_blocks * os.statvfs(store).f_frsize * 0.4
    assert (store / "remote-10.0.0.2.journal").exists()  # the active file is never vacuumed
    # A share that leaves no room: the limit is 0, never negative.
    assert tool.store_limit(store, 1, 100) == 0


class JournaldSocket:
    """A datagram socket that reads the native protocol the way journald does (KEY=value lines, or KEY\\n + 64-bit
    length + value for values with newlines; a passed memfd for entries too large for one datagram)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    def receive(self) -> dict[str, bytes]:
        self.sock.settimeout(5)
        data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 1)
        if fds:
            with os.fdopen(fds[0], "rb") as f:
                data = f.read()  # the descriptor is the sender's: at offset 0 (journald maps it from 0 too)
        fields, i = {}, 0
        while i < len(data):
            nl = data.index(b"\n", i)
            line = data[i:nl]
            if b"=" in line:
                key, value = line.split(b"=", 1)
                i = nl + 1
            else:
                key, (size,) = line, struct.unpack("<Q", data[nl + 1:nl + 9])
                value, i = data[nl + 9:nl + 9 + size], nl + 9 + size + 1
            fields[key.decode()] = value
        return fields


@pytest.fixture
def journald(tmp_path: Path):
    sock = JournaldSocket(tmp_path / "journal.sock")
    yield sock
    sock.sock.close()


def test_native_protocol_fields_newlines_and_large_entries(journald: JournaldSocket) -> None:
    assert journal.send({"MESSAGE": "two\nlines", "status": 200, "latency-ms": 12.5}, journald.path)
    assert journald.receive() == {"MESSAGE": b"two\nlines", "STATUS": b"200", "LATENCY_MS": b"12.5"}
    big = "x" * 600_000  # above a datagram's limit: sent as a sealed memfd, as journald accepts
    assert journal.send({"MESSAGE": "big", "BLOB": big}, journald.path)
    assert journald.receive()["BLOB"] == big.encode()
    with pytest.raises(ValueError):
        journal.field_name("_SYSTEMD_UNIT" * 0 + "!!!")


def test_no_journal_no_handler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    logger = logging.getLogger("shardstack.test.nojournal")
    assert journal.attach(logger, "x", str(tmp_path / "none")) is False and logger.propagate


def test_inference_access_log_is_a_structured_entry(journald: JournaldSocket, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardstack.serve import app

    monkeypatch.setenv("JOURNAL_STREAM", "8:123")  # what systemd sets for a service whose output is the journal
    logger = logging.getLogger("shardstack.test.access")
    monkeypatch.setattr(app, "access_log", logger)
    assert journal.attach(logger, "shardstack-inference", journald.path)
    try:
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("10.0.0.9", 51234),
                 "headers": [(b"x-request-id", b"req-42")]}
        app._log_access(scope, 200, 0.01234)
        fields = journald.receive()
    finally:
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    assert fields["MESSAGE"] == b"10.0.0.9 POST /v1/completions 200 12.3ms"
    assert {k: fields[k] for k in ("REQUEST_ID", "STATUS", "LATENCY_MS", "METHOD", "PATH", "CLIENT")} == {
        "REQUEST_ID": b"req-42", "STATUS": b"200", "LATENCY_MS": b"12.3", "METHOD": b"POST",
        "PATH": b"/v1/completions", "CLIENT": b"10.0.0.9"}
    assert fields["SYSLOG_IDENTIFIER"] == b"shardstack-inference" and fields["PRIORITY"] == b"6"


class _Backend(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_haproxy_access_log_is_one_json_object(tmp_path: Path) -> None:
    """The role's haproxy.cfg with its log line pointed at stdout instead of /dev/log (the rest as rendered), in
    front of a backend on loopback: each request is logged as one JSON object with the fields `shardstack logs`
    shows."""
    from .test_loadbalancer import free_port, render

    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    backend = ThreadingHTTPServer(("127.0.0.2", 0), _Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port, stats = free_port(), free_port()
    cfg = render("loadbalancer", "haproxy.cfg.j2", groups={"inference_nodes": ["a"]},
                 hostvars={"a": {"ansible_host": "127.0.0.2"}}, loadbalancer_bind="127.0.0.1",
                 loadbalancer_port=port, loadbalancer_stats_bind="127.0.0.1", loadbalancer_stats_port=stats,
                 loadbalancer_backend_port=backend.server_address[1],
                 loadbalancer_admin_socket=str(tmp_path / "admin.sock"))
    local_only = ("daemon", "chroot /var/lib/haproxy", "user haproxy", "group haproxy")
    cfg = "\n".join(line for line in cfg.splitlines() if line.strip() not in local_only)
    assert "    log /dev/log local0" in cfg
    (tmp_path / "haproxy.cfg").write_text(cfg.replace("log /dev/log local0", "log stdout format raw local0") + "\n")
    proc = subprocess.Popen([haproxy, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 20
        while True:  # until the health check has put the backend in
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health?x=1", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "HAProxy never answered 200"
            time.sleep(0.2)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        backend.shutdown()
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ok = [e for e in lines if e["STATUS"] == 200]
    assert ok, out
    assert ok[-1]["METHOD"] == "GET" and ok[-1]["PATH"] == "/health" and ok[-1]["SERVER"] == "a"
    assert isinstance(ok[-1]["LATENCY_MS"], int) and ok[-1]["BACKEND"] == "inference"
    # The same line as `shardstack logs` reads it from the journal: its keys become fields.
    line = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
    entry = logs_ops.parse_entry({"MESSAGE": line, "SYSLOG_IDENTIFIER": "haproxy", "__CURSOR": "c"})
    assert {"STATUS", "LATENCY_MS", "PATH"} <= set(entry.fields)


# What journalctl --output=json printed on a lab collector (fields trimmed), binary MESSAGE as a byte array.
RECORDED = [
    {"__CURSOR": "s=1;i=f1", "__REALTIME_TIMESTAMP": "1796112934785853", "_HOSTNAME": "n2", "PRIORITY": "5",
     "SYSLOG_IDENTIFIER": "shardstack-test", "MESSAGE": "tok2440326320", "_SYSTEMD_UNIT": "session-3.scope"},
    {"__CURSOR": "s=1;i=f2", "__REALTIME_TIMESTAMP": "1796112935000000", "_HOSTNAME": "n2", "PRIORITY": "6",
     "SYSLOG_IDENTIFIER": "shardstack-inference", "MESSAGE": "10.0.0.9 POST /v1/completions 200 12.3ms",
     "_SYSTEMD_UNIT": "shardstack-inference.service", "REQUEST_ID": "req-42", "STATUS": "200",
     "LATENCY_MS": "12.3", "CODE_LINE": "99"},
    {"__CURSOR": "s=1;i=f3", "__REALTIME_TIMESTAMP": "1796112936000000", "_HOSTNAME": "n1",
     "SYSLOG_IDENTIFIER": "haproxy", "MESSAGE": '{"CLIENT":"10.0.0.5","STATUS":503,"LATENCY_MS":3006}'},
    {"__CURSOR": "s=1;i=f4", "__REALTIME_TIMESTAMP": "1796112937000000", "_HOSTNAME": "n3",
     "MESSAGE": [104, 105, 10, 255]},
]


def test_journalctl_json_becomes_typed_entries() -> None:
    out = "\n".join(json.dumps(r) for r in RECORDED) + "\n-- No entries --\n"
    test, access, lb, binary = logs_ops.parse_output(out)
    assert (test.host, test.identifier, test.priority, test.message) == ("n2", "shardstack-test", 5, "tok2440326320")
    assert test.iso == "2026-12-01T08:15:34.785Z" and test.cursor == "s=1;i=f1"
    assert access.unit == "shardstack-inference.service"
    assert {k: access.fields[k] for k in ("REQUEST_ID", "STATUS", "LATENCY_MS")} == {
        "REQUEST_ID": "req-42", "STATUS": "200", "LATENCY_MS": "12.3"}
    assert lb.fields == {"CLIENT": "10.0.0.5", "STATUS": 503, "LATENCY_MS": 3006}
    assert binary.message == "hi\n\ufffd" and binary.priority is None
    assert json.loads(json.dumps(access.to_dict()))["time"] == "2026-12-01T08:15:35.000Z"


def test_the_query_journalctl_runs() -> None:
    q = logs_ops.LogQuery(host="n2", unit="shardstack-inference.service", since="-10min", grep="5\\d\\d", lines=20)
    assert logs_ops.journalctl_argv(q) == [
        "journalctl", "--merge", "--no-pager", "--quiet", "--output=json", "--unit=shardstack-inference.service",
        "--since=-10min", "--grep=5\\d\\d", "--lines=20", "_HOSTNAME=n2"]
    # Following: after the last cursor, no line count, no --since.
    assert logs_ops.journalctl_argv(q, "s=1;i=f4")[-2:] == ["--after-cursor=s=1;i=f4", "_HOSTNAME=n2"]


@pytest.mark.parametrize("argv, needle", [
    (["logs", "--since", "last tuesday"], "--since 'last tuesday' is not a time journalctl reads"),
    (["logs", "--grep", "(unclosed"], "is not a regular expression"),
    (["logs", "--lines", "0"], "--lines must be at least 1"),
])
def test_bad_arguments_are_usage_errors_before_any_node_is_asked(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    assert cli_main([*argv, "-i", "/nonexistent/hosts.yml"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
