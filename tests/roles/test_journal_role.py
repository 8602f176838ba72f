"""The journal role, rendered: journald's retention drop-in, the uploader's settings on a node, and the collector's
socket, service and timers (systemd-journal-remote and the retention of its store)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ansible_vars import load_module

REPO = Path(__file__).resolve().parents[2]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _journal(role_eval: Any, facts: dict, **kw: Any) -> Any:
    groups = {"all": ["n1", "n2"], "monitoring_server": ["n1"]}
    hostvars = {"n1": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
    kw.setdefault("inventory_dir", "/srv/inventory")
    return role_eval("journal", facts, groups=groups, hostvars=hostvars, **kw)


def test_journald_dropin_takes_the_disk_share_of_the_journal_filesystem(role_eval: Any, debian_container: dict) -> None:
    # df --output=size of a 200 GiB file system: 10 % of it, in MiB.
    r = _journal(role_eval, debian_container, inventory_hostname="n2",
                 __journal_df={"stdout_lines": ["1B-blocks", str(200 * 2**30)]})
    text = r.render("journald.conf.j2")
    assert text.startswith("#\n# Ansible managed\n#\n")
    assert _lines(text) == ["[Journal]", "Storage=persistent", "MaxRetentionSec=30day", "MaxFileSec=1week",
                            f"SystemMaxUse={200 * 1024 // 10}M"]


def test_journald_dropin_explicit_limits(role_eval: Any, debian_container: dict) -> None:
    r = _journal(role_eval, debian_container, journal_system_max_use="50G", journal_system_keep_free="20G",
                 journal_max_retention="90day")
    lines = _lines(r.render("journald.conf.j2"))
    assert "SystemMaxUse=50G" in lines and "SystemKeepFree=20G" in lines and "MaxRetentionSec=90day" in lines


def test_journald_dropin_without_a_size_leaves_journald_its_default(role_eval: Any, debian_container: dict) -> None:
    # No df result (a dry run before the journal exists): no SystemMaxUse rather than a wrong one.
    r = _journal(role_eval, debian_container)
    assert not [line for line in _lines(r.render("journald.conf.j2")) if line.startswith("SystemMaxUse")]


def test_nodes_upload_over_mutual_tls_to_the_first_monitoring_server(role_eval: Any, debian_container: dict) -> None:
    r = _journal(role_eval, debian_container, inventory_hostname="n2")
    assert r["__journal_upload_active"] is True and r["__journal_tls_active"] is True
    assert _lines(r.render("journal-upload.conf.j2")) == [
        "[Upload]", "URL=https://10.0.0.1:19532",
        "ServerKeyFile=/run/credentials/systemd-journal-upload.service/journal-upload.key",
        "ServerCertificateFile=/etc/shardstack-journal/tls/upload.crt",
        "TrustedCertificateFile=/etc/shardstack-journal/tls/ca.crt"]
    unit = _lines(r.render("journal-upload.service.conf.j2"))
    assert "StartLimitIntervalSec=0" in unit and "Restart=always" in unit
    # The key is root-only on disk; the dynamic user of journal-upload gets it as a credential.
    assert "LoadCredential=journal-upload.key:/etc/shardstack-journal/tls/upload.key" in unit
    # A client certificate under the node's own name (journal-remote files its entries under it), from the cluster
    # CA in the same store as the loadbalancer's.
    assert (r["__journal_tls_usage"], r["__journal_tls_names"]) == ("client", ["n2"])
    assert r["journal_tls_store"] == "/srv/inventory/credentials"
    assert r["__journal_cert_store"] == "/srv/inventory/credentials/journal-n2.crt.txt"
    # gate.yml reads the collector's pair by those names: they are what shardstack_common's cluster_certificate.yml
    # issues for the role's prefix.
    common = role_eval("shardstack_common", debian_container, inventory_hostname="n2",
                       __shardstack_common_tls_store="/srv/inventory/credentials",
                       __shardstack_common_tls_prefix="journal")
    assert common["__shardstack_common_tls_own"] + ".key.txt" == r["__journal_key_store"]


def test_plain_http_is_kept_for_debugging(role_eval: Any, debian_container: dict) -> None:
    r = _journal(role_eval, debian_container, inventory_hostname="n2", journal_transport="http")
    assert r["__journal_tls_active"] is False
    assert _lines(r.render("journal-upload.conf.j2")) == ["[Upload]", "URL=http://10.0.0.1:19532"]
    assert not [line for line in _lines(r.render("journal-upload.service.conf.j2")) if "Credential" in line]
    c = _collector(role_eval, debian_container, journal_transport="http")
    assert _lines(c.render("journal-remote.service.conf.j2"))[-1] == (
        "ExecStart=/lib/systemd/systemd-journal-remote --listen-http=-3 --split-mode=host "
        "--output=/var/log/journal/remote/")


def test_the_collector_does_not_upload_to_itself(role_eval: Any, debian_container: dict) -> None:
    assert _journal(role_eval, debian_container, inventory_hostname="n1")["__journal_upload_active"] is False
    collector = _journal(role_eval, debian_container, inventory_hostname="n1")
    assert collector["__journal_is_collector"] is True
    # The package brings both ends: each node stops the one it does not run.
    assert collector["__journal_unwanted_units"] == ["systemd-journal-upload.service"]
    assert _journal(role_eval, debian_container, inventory_hostname="n2")["__journal_unwanted_units"] == [
        "systemd-journal-remote.socket", "systemd-journal-remote.service"]
    assert role_eval("journal", debian_container)["__journal_upload_active"] is False  # no monitoring_server
    r = _journal(role_eval, debian_container, inventory_hostname="n2", journal_upload_enabled=False)
    assert (r["__journal_upload_active"], r["__journal_is_collector"]) == (False, False)


def test_every_host_gets_its_own_gate_source_beyond_one_block(role_eval: Any, debian_container: dict) -> None:
    hosts = ["mon"] + [f"n{i:03d}" for i in range(600)]
    groups = {"all": hosts, "monitoring_server": ["mon"]}
    hostvars = {h: {"ansible_host": f"10.0.{i // 250}.{i % 250 + 1}"} for i, h in enumerate(hosts)}
    r = role_eval("journal", debian_container, groups=groups, hostvars=hostvars, inventory_hostname="mon",
                  ansible_host="10.0.0.1", inventory_dir="/srv/inventory")
    sources = r["__journal_gate_sources"]
    assert len(set(sources.values())) == len(hosts) == len(sources)
    assert (sources["mon"], sources["n248"], sources["n249"], sources["n599"]) == (
        "127.77.0.2", "127.77.0.251", "127.77.1.2", "127.77.2.102")


def _collector(role_eval: Any, facts: dict, **kw: Any) -> Any:
    groups = {"all": ["mon", "n2"], "monitoring_server": ["mon"]}
    hostvars = {"mon": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
    kw.setdefault("ansible_host", "10.0.0.1")
    kw.setdefault("inventory_dir", "/srv/inventory")
    return role_eval("journal", facts, groups=groups, hostvars=hostvars, inventory_hostname="mon", **kw)


def test_collector_gate_takes_mutual_tls_and_journal_remote_stays_on_loopback(
        role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    r = _collector(role_eval, debian_container, journal_collector_tls_names=["logs.example"])
    # Debian 12's journal-remote cannot check client certificates: it listens on loopback, in HTTP, behind the gate.
    assert _lines(r.render("journal-remote.socket.conf.j2")) == [
        "[Socket]", "ListenStream=", "ListenStream=127.0.0.1:19533", "FreeBind=yes"]
    service = _lines(r.render("journal-remote.service.conf.j2"))
    assert service[-1] == ("ExecStart=/lib/systemd/systemd-journal-remote --listen-http=-3 --split-mode=host "
                           "--output=/var/log/journal/remote/")
    gate = r.render("journal-gate.cfg.j2")
    assert ('    bind 10.0.0.1:19532 ssl crt "${CREDENTIALS_DIRECTORY}/remote.pem" '
            "ca-file /etc/shardstack-journal/tls/ca.crt verify required") in gate.splitlines()
    assert "    use_backend node_n2 if { ssl_c_s_dn(CN) -m str n2 }" in gate.splitlines()
    assert "    server journal-remote 127.0.0.1:19533 source 127.77.0.3" in gate.splitlines()
    assert "    default_backend refused" in gate.splitlines()
    # A server certificate for every name nodes upload to.
    assert (r["__journal_tls_usage"], r["__journal_tls_names"]) == ("server", ["mon", "10.0.0.1", "logs.example"])
    # Sources journal-remote names files after (address, or the gate's loopback address) -> inventory names.
    # "local": the collector's own journal, for `shardstack logs --host mon`.
    assert r["__journal_source_map"] == {"10.0.0.1": "mon", "10.0.0.2": "n2", "mon": "mon", "n2": "n2",
                                         "127.77.0.2": "mon", "127.77.0.3": "n2", "local": "mon"}
    # HAProxy itself accepts the configuration (with a certificate where the credential will be).
    cc = load_module(REPO / "roles/shardstack_common/library/cluster_certificate.py")
    files = [tmp_path / n for n in ("ca.crt", "ca.key", "remote.crt", "remote.key")]
    p = cc.plan(*files, ["mon", "10.0.0.1"], renew_days=30)
    cc.apply(p, *files, ["mon", "10.0.0.1"], ca_common_name="test CA", valid_days=30)
    (tmp_path / "remote.pem").write_text(files[2].read_text() + files[3].read_text())
    conf = tmp_path / "gate.cfg"
    conf.write_text(gate.replace("/etc/shardstack-journal/tls/ca.crt", str(files[0])))
    check = subprocess.run(["haproxy", "-c", "-f", str(conf)], capture_output=True, text=True,
                           env={**os.environ, "CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert check.returncode == 0, check.stdout + check.stderr


def test_collector_on_a_named_host_listens_everywhere(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container, ansible_host="mon.example")
    assert "    bind :19532 ssl" in r.render("journal-gate.cfg.j2")
    r = _collector(role_eval, debian_container, ansible_host="mon.example", journal_transport="http")
    assert "ListenStream=19532" in _lines(r.render("journal-remote.socket.conf.j2"))


def test_collector_timers_keep_its_store_within_retention_and_share(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container, journal_collector_max_retention="90day",
                   journal_collector_disk_share_percent=25)
    vacuum = _lines(r.render("shardstack-log-vacuum.service.j2"))
    assert ("ExecStart=/usr/local/libexec/shardstack/log-collector --store=/var/log/journal/remote --disk-share=25 "
            "--keep-free=15 vacuum --retention=90day") in vacuum
    assert "ReadWritePaths=-/var/log/journal/remote" in vacuum and "PrivateNetwork=yes" in vacuum
    assert "OnCalendar=hourly" in _lines(r.render("shardstack-log-vacuum.timer.j2"))
    metrics = _lines(r.render("shardstack-log-metrics.service.j2"))
    assert any(line.startswith("ExecStart=") and "--textfile=/var/lib/prometheus/node-exporter/shardstack_logs.prom"
               in line and "--local-name=mon" in line for line in metrics)


RSYSLOGD = shutil.which("rsyslogd") or "/usr/sbin/rsyslogd"


def _rsyslog_check(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`rsyslogd -N1` (parse, load every module, check every parameter, start nothing) on the rendered file."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    conf = tmp_path / "rsyslog.conf"
    conf.write_text(text.replace("/var/lib/shardstack-log-forward", str(state)))
    return subprocess.run([RSYSLOGD, "-N1", "-f", str(conf)], capture_output=True, text=True)


def test_no_forwarder_by_default(role_eval: Any, debian_container: dict) -> None:
    assert _collector(role_eval, debian_container)["__journal_forward_active"] is False
    assert _journal(role_eval, debian_container, inventory_hostname="n2",
                    journal_forward_url="https://es:9200")["__journal_forward_active"] is False  # collector only


def test_forwarder_to_elasticsearch_is_valid_rsyslog_with_a_disk_assisted_queue(
        role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    secret = tmp_path / "es-credentials"
    secret.write_text("shipper:s3cret-pw\n")
    ca = tmp_path / "es-ca.pem"  # rsyslogd -N1 checks that it exists
    ca.write_text("")
    r = _collector(role_eval, debian_container, journal_forward_url="https://es.example:9200/",
                   journal_forward_credentials_file=str(secret), journal_forward_ca_file=str(ca))
    assert r["__journal_forward_active"] is True
    assert r["__journal_forward_packages"] == ["rsyslog", "rsyslog-elasticsearch"]
    text = r.render("log-forward.rsyslog.conf.j2")
    assert 'server="https://es.example:9200"' in text and 'searchIndex="shardstack-logs"' in text
    assert 'uid="shipper" pwd="s3cret-pw"' in text and f'tls.cacert="{ca}"' in text
    # The whole store (Remote), a queue on disk kept over restarts, retried for ever; no input that listens.
    assert 'Remote="on"' in text and 'queue.filename="forward"' in text and 'queue.saveOnShutdown="on"' in text
    assert 'action.resumeRetryCount="-1"' in text
    assert not re.search(r'load="(imtcp|imudp|imptcp|imrelp|imhttp)"', text)
    check = _rsyslog_check(text, tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


def test_forwarder_to_loki_is_valid_rsyslog(role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    r = _collector(role_eval, debian_container, journal_forward_url="http://loki.example:3100",
                   journal_forward_kind="loki")
    assert r["__journal_forward_packages"] == ["rsyslog"]
    text = r.render("log-forward.rsyslog.conf.j2")
    assert 'type="omprog"' in text and "--config=/etc/shardstack-journal/log-forward/loki.json" in text
    assert 'confirmMessages="on"' in text and 'queue.filename="forward"' in text and "pwd=" not in text
    check = _rsyslog_check(text, tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


def _loki_sender() -> Any:
    return load_module(REPO / "roles/journal/files/loki-push.py")


def test_loki_sender_confirms_a_batch_only_once_loki_took_it(tmp_path: Path) -> None:
    import base64
    import io
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    got: list[tuple[str, dict, str]] = []
    status = [204]

    class Loki(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body, self.headers.get("Authorization", "")))
            self.send_response(status[0])
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Loki)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        creds = tmp_path / "credentials"
        creds.write_text("shipper:pw\n")
        loki = _loki_sender()
        sender = loki.Sender({"url": f"http://127.0.0.1:{server.server_port}/", "labels": {"job": "shardstack"},
                              "credentials_file": str(creds)})
        entries = [{"ts": "2026-01-01T00:00:00.5+00:00", "host": "node2", "unit": "a.service", "message": "one"},
                   {"ts": "2026-01-01T00:00:01+00:00", "host": "node2", "unit": "a.service", "message": "two"},
                   {"host": "node3", "message": "three"}]
        stdin = io.StringIO("\n".join(["BEGIN TRANSACTION", *map(json.dumps, entries), "COMMIT TRANSACTION"]) + "\n")
        out = io.StringIO()
        loki.serve(sender, stdin, out)
        assert out.getvalue().split() == ["OK", "OK", "DEFER_COMMIT", "DEFER_COMMIT", "DEFER_COMMIT", "OK"]
        path, body, auth = got[0]
        assert path == "/loki/api/v1/push" and auth == "Basic " + base64.b64encode(b"shipper:pw").decode()
        streams = {s["stream"]["host"]: s for s in body["streams"]}
        assert streams["node2"]["stream"] == {"job": "shardstack", "host": "node2", "unit": "a.service"}
        assert streams["node2"]["values"] == [["1767225600500000000", "one"], ["1767225601000000000", "two"]]
        assert streams["node3"]["stream"] == {"job": "shardstack", "host": "node3"}
        # Loki refuses: the commit is answered with an error, so rsyslog keeps the batch in its queue and retries.
        status[0] = 500
        out = io.StringIO()
        loki.serve(sender, io.StringIO(f"BEGIN TRANSACTION\n{json.dumps(entries[0])}\nCOMMIT TRANSACTION\n"), out)
        assert out.getvalue().split("\n")[3] == "Error: HTTP 500"
    finally:
        server.shutdown()
    # Loki down altogether: an error too, never OK.
    assert _loki_sender().Sender({"url": "http://127.0.0.1:9"}).push(entries[:1]).startswith("Error: ")
