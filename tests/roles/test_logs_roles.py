"""Central logs, rendered: journald's retention drop-in, the uploader's and the collector's settings (HTTP now, HTTPS
with the cluster CA), and the optional forwarders - rsyslog's Elasticsearch configuration through rsyslog's own check
(`rsyslogd -N1`, which fails on a mistyped parameter), Alloy's Loki configuration as far as it can be checked here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

RSYSLOGD = shutil.which("rsyslogd") or "/usr/sbin/rsyslogd"


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _journal(role_eval: Any, facts: dict, **kw: Any) -> Any:
    groups = {"all": ["n1", "n2"], "monitoring_server": ["n1"]}
    hostvars = {"n1": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
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


def test_nodes_upload_over_http_to_the_first_monitoring_server(role_eval: Any, debian_container: dict) -> None:
    r = _journal(role_eval, debian_container, inventory_hostname="n2")
    assert r["__journal_upload_active"] is True
    assert _lines(r.render("journal-upload.conf.j2")) == ["[Upload]", "URL=http://10.0.0.1:19532"]
    unit = _lines(r.render("journal-upload.service.conf.j2"))
    assert "StartLimitIntervalSec=0" in unit and "Restart=always" in unit
    assert not [line for line in unit if line.startswith("LoadCredential")]


def test_the_collector_does_not_upload_to_itself(role_eval: Any, debian_container: dict) -> None:
    assert _journal(role_eval, debian_container, inventory_hostname="n1")["__journal_upload_active"] is False
    assert role_eval("journal", debian_container)["__journal_upload_active"] is False  # no monitoring_server


def test_https_upload_reads_its_key_through_credentials(role_eval: Any, debian_container: dict) -> None:
    r = role_eval("journal", debian_container, inventory_hostname="n2", journal_upload_tls=True,
                  groups={"all": ["n1", "n2"], "monitoring_server": ["n1"]},
                  hostvars={"n1": {"ansible_host": "fd00::1"}})
    creds = "/run/credentials/systemd-journal-upload.service"
    assert _lines(r.render("journal-upload.conf.j2")) == [
        "[Upload]", "URL=https://[fd00::1]:19532", f"ServerKeyFile={creds}/journal-upload.key",
        f"ServerCertificateFile={creds}/journal-upload.crt", f"TrustedCertificateFile={creds}/cluster-ca.crt"]
    unit = _lines(r.render("journal-upload.service.conf.j2"))
    assert "LoadCredential=journal-upload.key:/etc/shardstack/tls/journal-upload.key" in unit


def _collector(role_eval: Any, facts: dict, **kw: Any) -> Any:
    groups = {"all": ["mon", "n2"], "monitoring_server": ["mon"]}
    hostvars = {"mon": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
    kw.setdefault("ansible_host", "10.0.0.1")
    return role_eval("log_collector", facts, groups=groups, hostvars=hostvars, inventory_hostname="mon", **kw)


def test_collector_listens_on_the_internal_address_over_http(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container)
    assert _lines(r.render("journal-remote.socket.conf.j2")) == [
        "[Socket]", "ListenStream=", "ListenStream=10.0.0.1:19532", "FreeBind=yes"]
    service = _lines(r.render("journal-remote.service.conf.j2"))
    assert service[-1] == ("ExecStart=/lib/systemd/systemd-journal-remote --listen-http=-3 --split-mode=host "
                           "--output=/var/log/journal/remote/")
    # Sources journal-remote names files after (address, or certificate name) -> inventory names.
    assert r["__log_collector_source_map"] == {"10.0.0.1": "mon", "10.0.0.2": "n2", "mon": "mon", "n2": "n2"}


def test_collector_on_a_named_host_listens_everywhere(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container, ansible_host="mon.example")
    assert "ListenStream=19532" in _lines(r.render("journal-remote.socket.conf.j2"))


def test_collector_over_https(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container, log_collector_tls=True)
    service = _lines(r.render("journal-remote.service.conf.j2"))
    assert any("--listen-https=-3" in line and "--trust=%d/cluster-ca.crt" in line for line in service)
    assert "LoadCredential=journal-remote.key:/etc/shardstack/tls/journal-remote.key" in service


def _rsyslog_check(path: Path) -> subprocess.CompletedProcess:
    if not Path(RSYSLOGD).exists():
        pytest.fail("rsyslogd not found: apt-get install rsyslog rsyslog-elasticsearch (make setup does)")
    return subprocess.run([RSYSLOGD, "-N1", "-f", str(path)], capture_output=True, text=True)


def test_elasticsearch_forwarder_passes_rsyslogs_check(role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    r = _collector(role_eval, debian_container, log_collector_forward_elasticsearch_url="https://es.example:9200")
    text = r.render("rsyslog-forward.conf.j2")
    assert 'server="https://es.example:9200"' in text and 'module(load="imjournal" Remote="on"' in text
    conf = tmp_path / "rsyslog.conf"
    conf.write_text(text)
    proc = _rsyslog_check(conf)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The check is worth something: one mistyped parameter of the Elasticsearch action fails it.
    conf.write_text(text.replace("dynSearchIndex=", "dynSerchIndex="))
    proc = _rsyslog_check(conf)
    assert proc.returncode != 0 and "dynSerchIndex" in proc.stdout + proc.stderr


def test_loki_forwarder_config_is_well_formed(role_eval: Any, debian_container: dict) -> None:
    """No Alloy binary here (Grafana's repository is out of reach; on the node the role checks the file with
    `alloy fmt` before it replaces the old one): check its shape - balanced blocks, every component it refers to
    defined, the URL and both journal sources."""
    url = "http://loki.example:3100/loki/api/v1/push"
    text = _collector(role_eval, debian_container, log_collector_forward_loki_url=url).render("config.alloy.j2")
    assert text.splitlines()[1] == "// Ansible managed"
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    assert body.count("{") == body.count("}") and body.count("[") == body.count("]")
    defined = set(re.findall(r'^([a-z_]+\.[a-z_.]+) "([a-z_]+)" \{', body, re.M))
    assert defined == {("loki.source.journal", "central"), ("loki.source.journal", "collector"),
                       ("loki.relabel", "journal"), ("loki.write", "default")}
    used = set(re.findall(r"\b(loki\.[a-z_.]+?)\.([a-z_]+)\.(?:receiver|rules)\b", body))
    assert used and used <= defined, used - defined
    assert f'url = "{url}"' in body and 'path          = "/var/log/journal/remote"' in body
    for line in body.splitlines():  # attribute lines are `name = value`
        if "=" in line and not line.strip().startswith(("rule", "endpoint")):
            assert re.match(r'^\s+[a-z_]+\s+= .+$', line), line
