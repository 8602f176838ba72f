"""Central logs on this machine, with the real tools: journal files written by systemd-journal-remote, read by the
collector's metrics and retention tool (roles/journal/files/log-collector.py) through journalctl; `shardstack logs`
parsing journalctl's JSON, the journalctl it runs on the collector, and bad arguments refused before any node is
asked."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_vars import load_vars
from shardstack.cli import main as cli_main
from shardstack.ops import logs as logs_ops

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "roles/journal/files/log-collector.py"
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
    # --keep-free 0: the limit must not depend on how full this host's disk happens to be (CI's was > 85% once).
    argv = ["--store", str(store), "--keep-free", "0", "metrics", "--textfile", str(prom), "--state", str(state),
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


def test_a_hosts_query_reads_its_own_files_not_entries_that_name_it(tmp_path: Path) -> None:
    """`shardstack logs --host n2` on the collector: n2's files (active and archived), not n3's entries that call
    themselves n2; an unknown name is exit 2 with the names there are; only journalctl, choosing no files itself."""
    store, sources = tmp_path / "remote", tmp_path / "sources.json"
    store.mkdir()
    sources.write_text(json.dumps({"127.77.0.2": "n2", "127.77.0.3": "n3", "local": "mon"}))
    now = time.time()
    _write(store / "remote-127.77.0.2@0123abcd-0000000000000001-0005f3a1b2c3d4e5.journal",
           [_entry("n2", "archived n2", now - 40)])
    _write(store / "remote-127.77.0.2.journal", [_entry("n2", "from n2", now - 30)])
    _write(store / "remote-127.77.0.3.journal", [_entry("n2", "forged by n3", now - 20)])  # n3 claims to be n2

    def run(host: str, *journalctl: str) -> subprocess.CompletedProcess:
        cmd = journalctl or ("journalctl", "--no-pager", "--quiet", "--output=json", "--lines=100")
        return subprocess.run([sys.executable, str(TOOL), f"--store={store}", "query", f"--sources={sources}",
                               f"--host={host}", "--", *cmd], capture_output=True, text=True, timeout=60)

    def messages(proc: subprocess.CompletedProcess) -> list[str]:
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line)["MESSAGE"] for line in proc.stdout.splitlines()]

    assert messages(run("n2")) == ["archived n2", "from n2"]
    assert messages(run("n3")) == ["forged by n3"]
    unknown = run("n9")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "no journal of n9 at this collector (hosts with one: mon, n2, n3)" in unknown.stderr
    for cmd in (("journalctl", "--merge"), ("journalctl", f"--directory={store}"), ("sh", "-c", "id")):
        refused = run("n2", *cmd)
        assert refused.returncode == 2 and "the command must be journalctl" in refused.stderr


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
    proc = subprocess.run([sys.executable, str(TOOL), "--store", str(store), "--disk-share", "40", "--keep-free", "0",
                           "vacuum", "--retention", "30day"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    st = os.statvfs(store)
    total, avail = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    limit = tool.store_limit(store, 40, 0)
    assert f"{store}: {tool.store_bytes(store)} bytes, limit" in proc.stdout
    assert 0 < limit <= total * 0.4
    # The free share kept comes off the limit: what would leave less than keep_free of the disk free.
    free_share = 100 * avail / total
    assert tool.store_limit(store, 100, 0) > tool.store_limit(store, 100, free_share / 2) > 0
    assert (store / "remote-10.0.0.2.journal").exists()  # the active file is never vacuumed
    # A share that leaves no room: the limit is 0, never negative.
    assert tool.store_limit(store, 1, 100) == 0


# What journalctl --output=json printed on a lab collector (fields trimmed), binary MESSAGE as a byte array.
RECORDED = [
    {"__CURSOR": "s=1;i=f1", "__REALTIME_TIMESTAMP": "1796112934785853", "_HOSTNAME": "n2", "PRIORITY": "5",
     "SYSLOG_IDENTIFIER": "shardstack-test", "MESSAGE": "tok2440326320", "_SYSTEMD_UNIT": "session-3.scope"},
    {"__CURSOR": "s=1;i=f2", "__REALTIME_TIMESTAMP": "1796112935000000", "_HOSTNAME": "n2", "PRIORITY": "6",
     "SYSLOG_IDENTIFIER": "torchrun", "MESSAGE": "step 30 loss 4.1210",
     "_SYSTEMD_UNIT": "shardstack-train@run1.service", "CODE_LINE": "99", "SYSLOG_FACILITY": "3", "_PID": "4242"},
    {"__CURSOR": "s=1;i=f3", "__REALTIME_TIMESTAMP": "1796112936000000", "_HOSTNAME": "n1", "_COMM": "haproxy",
     "MESSAGE": '{"status":503}', "UNIT": "haproxy.service"},
    {"__CURSOR": "s=1;i=f4", "__REALTIME_TIMESTAMP": "1796112937000000", "_HOSTNAME": "n3",
     "MESSAGE": [104, 105, 10, 255]},
]


def test_journalctl_json_becomes_typed_entries() -> None:
    out = "\n".join(json.dumps(r) for r in RECORDED) + "\n-- No entries --\n"
    test, job, lb, binary = logs_ops.parse_output(out)
    assert (test.host, test.identifier, test.priority, test.message) == ("n2", "shardstack-test", 5, "tok2440326320")
    assert test.iso == "2026-12-01T08:15:34.785Z" and test.cursor == "s=1;i=f1"
    # The entry's own fields come along; journald's trusted `_…` ones and those shown in columns do not.
    assert (job.unit, job.identifier, job.fields) == ("shardstack-train@run1.service", "torchrun", {"CODE_LINE": "99"})
    # No identifier: the command's name; the unit systemd logged about.
    assert (lb.identifier, lb.unit, lb.message) == ("haproxy", "haproxy.service", '{"status":503}')
    assert binary.message == "hi\n\ufffd" and binary.priority is None
    assert json.loads(json.dumps(job.to_dict()))["time"] == "2026-12-01T08:15:35.000Z"


def test_the_query_journalctl_runs() -> None:
    q = logs_ops.LogQuery(unit="shardstack-inference.service", since="-10min", grep="5\\d\\d", lines=20)
    assert logs_ops.journalctl_argv(q) == [
        "journalctl", "--merge", "--no-pager", "--quiet", "--output=json", "--unit=shardstack-inference.service",
        "--since=-10min", "--grep=5\\d\\d", "--lines=20"]
    # Following: after the last cursor, no line count, no --since.
    assert logs_ops.journalctl_argv(q, "s=1;i=f4")[-1] == "--after-cursor=s=1;i=f4"
    # One host: its own files through the journal role's collector tool, never a _HOSTNAME match.
    q.host = "n2"
    assert logs_ops.journalctl_argv(q) == [
        "/usr/local/libexec/shardstack/log-collector", "--store=/var/log/journal/remote", "query",
        "--sources=/etc/shardstack-journal/sources.json", "--host=n2", "--", "journalctl", "--no-pager", "--quiet",
        "--output=json", "--unit=shardstack-inference.service", "--since=-10min", "--grep=5\\d\\d", "--lines=20"]
    # A training job is its template unit on every train node.
    job = logs_ops.LogQuery(job="run1")
    job.check()
    assert logs_ops.journalctl_argv(job)[5:] == ["--unit=shardstack-train@run1.service", "--lines=100"]


def test_the_collector_paths_are_the_journal_roles() -> None:
    role = load_vars(ROOT / "roles/journal/vars/main.yml")
    etc = role["__journal_etc"]
    assert role["__journal_tool"] == logs_ops.COLLECTOR_TOOL
    assert role["__journal_sources"].replace("{{ __journal_etc }}", etc) == logs_ops.COLLECTOR_SOURCES
    assert role["__journal_store_dir"] == logs_ops.COLLECTOR_STORE


@pytest.mark.parametrize("argv, needle", [
    (["logs", "--since", "last tuesday"], "--since 'last tuesday' is not a time journalctl reads"),
    (["logs", "--grep", "(unclosed"], "is not a regular expression"),
    (["logs", "--lines", "0"], "--lines must be at least 1"),
    (["logs", "--job", "Run 1"], "job name 'Run 1' is not valid"),
    (["logs", "--job", "run1", "--unit", "x.service"], "--job and --unit both name a unit"),
])
def test_bad_arguments_are_usage_errors_before_any_node_is_asked(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    assert cli_main([*argv, "-i", "/nonexistent/hosts.yml"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
