"""The journal role, rendered: journald's retention drop-in, the uploader's settings on a node, and the collector's
socket, service and timers (systemd-journal-remote and the retention of its store)."""

from __future__ import annotations

from typing import Any


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


def _collector(role_eval: Any, facts: dict, **kw: Any) -> Any:
    groups = {"all": ["mon", "n2"], "monitoring_server": ["mon"]}
    hostvars = {"mon": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
    kw.setdefault("ansible_host", "10.0.0.1")
    return role_eval("journal", facts, groups=groups, hostvars=hostvars, inventory_hostname="mon", **kw)


def test_collector_listens_on_the_internal_address_over_http(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container)
    assert _lines(r.render("journal-remote.socket.conf.j2")) == [
        "[Socket]", "ListenStream=", "ListenStream=10.0.0.1:19532", "FreeBind=yes"]
    service = _lines(r.render("journal-remote.service.conf.j2"))
    assert service[-1] == ("ExecStart=/lib/systemd/systemd-journal-remote --listen-http=-3 --split-mode=host "
                           "--output=/var/log/journal/remote/")
    # Sources journal-remote names files after (address, or certificate name) -> inventory names.
    assert r["__journal_source_map"] == {"10.0.0.1": "mon", "10.0.0.2": "n2", "mon": "mon", "n2": "n2"}


def test_collector_on_a_named_host_listens_everywhere(role_eval: Any, debian_container: dict) -> None:
    r = _collector(role_eval, debian_container, ansible_host="mon.example")
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
