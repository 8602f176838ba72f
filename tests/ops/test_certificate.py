"""shardstack_common's cluster_certificate module (the loadbalancer's and the journal's): a CA once, a server
certificate the real `openssl verify` accepts for the load balancer's names, client certificates for the journal,
nothing re-issued on a re-run, re-issued when the names or the usage change, the expiry nears or the CA changed,
keys owner-only, check mode that writes nothing, and results without key material."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROLES, certificate_module, issue, store_files

cc = certificate_module()
NAMES = ["lb", "10.0.0.1", "llm.example.com"]


def openssl_verify(files: dict[str, Path], *checks: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["openssl", "verify", "-purpose", "sslserver", "-CAfile", str(files["ca_cert"]), *checks,
                           str(files["cert"])], capture_output=True, text=True)


def plan(files: dict[str, Path], names: list[str] = NAMES, renew_days: int = 30):
    return cc.plan(*files.values(), names, renew_days=renew_days)


def test_issues_a_ca_and_a_server_certificate_openssl_accepts(tmp_path: Path) -> None:
    files = issue(tmp_path / "credentials", "lb", NAMES)
    for check in (["-verify_ip", "10.0.0.1"], ["-verify_hostname", "llm.example.com"], ["-verify_hostname", "lb"]):
        assert openssl_verify(files, *check).returncode == 0, check
    wrong = openssl_verify(files, "-verify_hostname", "other.example.com")
    assert wrong.returncode != 0 and "hostname mismatch" in wrong.stdout + wrong.stderr
    assert (files["ca_key"].stat().st_mode & 0o777, files["key"].stat().st_mode & 0o777) == (0o600, 0o600)
    assert files["ca_key"].parent.stat().st_mode & 0o777 == 0o700
    assert not [p for p in files["ca_key"].parent.iterdir() if p.name.startswith(".")]  # no temporary files left
    assert plan(files).reasons == []  # a second run changes nothing


def test_reissues_for_new_names_an_expiry_or_another_ca_and_keeps_the_keys(tmp_path: Path) -> None:
    files = issue(tmp_path / "credentials", "lb", NAMES)
    ca, key = files["ca_cert"].read_bytes(), files["key"].read_bytes()
    assert plan(files, [*NAMES, "10.0.0.9"]).reasons == [
        f"re-issue {files['cert']}: names ['10.0.0.1', 'lb', 'llm.example.com'] -> "
        "['10.0.0.1', '10.0.0.9', 'lb', 'llm.example.com']"]
    # Issued for 90 days: re-issued by a run that renews 91 days ahead.
    assert plan(files, renew_days=91).reasons[0].startswith(f"re-issue {files['cert']}: expires")
    issue(tmp_path / "credentials", "lb", [*NAMES, "10.0.0.9"])
    assert openssl_verify(files, "-verify_ip", "10.0.0.9").returncode == 0
    assert (files["ca_cert"].read_bytes(), files["key"].read_bytes()) == (ca, key)
    # A new CA (both of its files gone): everything it signed is issued again.
    files["ca_cert"].unlink()
    files["ca_key"].unlink()
    assert plan(files).reasons[0].startswith("new cluster CA")
    other = store_files(tmp_path / "other", "lb")
    issue(tmp_path / "other", "lb", NAMES)
    mixed = {**files, "ca_cert": other["ca_cert"], "ca_key": other["ca_key"]}
    issue(tmp_path / "credentials", "lb", NAMES)
    assert plan(mixed).reasons == [f"re-issue {files['cert']}: not signed by the CA in {other['ca_cert']}"]


def test_names_are_compared_as_they_read_back() -> None:
    # Otherwise a name spelled differently in the inventory would re-issue the certificate on every run.
    assert [cc.canonical(n) for n in ("2001:DB8::1", "LB.Example.com", "10.0.0.1")] == [
        "2001:db8::1", "lb.example.com", "10.0.0.1"]


def test_half_a_ca_is_an_error_not_a_new_ca(tmp_path: Path) -> None:
    files = issue(tmp_path / "credentials", "lb", NAMES)
    files["ca_key"].unlink()
    with pytest.raises(ValueError, match=r"exists but .*cluster-ca\.key\.txt does not: restore it"):
        plan(files)


def _module(files: dict[str, Path], *flags: str) -> dict:
    """The module as Ansible runs it (AnsiballZ, its argument spec), on localhost."""
    args = json.dumps({**{k: str(v) for k, v in files.items()}, "names": NAMES})
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible"), "localhost", "-i", "localhost,", "-c", "local", "-o",
         "-M", str(ROLES / "shardstack_common" / "library"), "-m", "cluster_certificate", "-a", args,
         "-e", f"ansible_python_interpreter={sys.executable}", *flags],
        capture_output=True, text=True, env={**os.environ, "ANSIBLE_CONFIG": str(ROLES.parent / "ansible.cfg")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.split("=>", 1)[1])


def test_under_ansible_check_mode_writes_nothing_and_results_hold_no_key(tmp_path: Path) -> None:
    files = store_files(tmp_path / "credentials", "lb")
    dry = _module(files, "--check")
    assert dry["changed"] and len(dry["reasons"]) == 3 and not files["ca_key"].parent.exists()
    real = _module(files)
    assert real["changed"] and real["reasons"] == dry["reasons"]
    again = _module(files)
    assert not again["changed"] and again["reasons"] == [] and again["not_after"] == real["not_after"]
    secrets = [files["ca_key"].read_text(), files["key"].read_text()]
    body_lines = [line for s in secrets for line in s.splitlines() if "-----" not in line]
    assert body_lines and not any(line in json.dumps([dry, real, again]) for line in body_lines)


def test_client_certificates_for_the_journal_and_a_changed_usage_reissues(tmp_path: Path) -> None:
    files = store_files(tmp_path / "credentials", "node2")
    p = cc.plan(*files.values(), ["node2"], renew_days=30, usage="client")
    assert p.reasons[-1] == f"new client certificate for node2: {files['cert']}"
    cc.apply(p, *files.values(), ["node2"], ca_common_name="test cluster CA", valid_days=90, usage="client")
    client = subprocess.run(["openssl", "verify", "-purpose", "sslclient", "-CAfile", str(files["ca_cert"]),
                             str(files["cert"])], capture_output=True, text=True)
    assert client.returncode == 0, client.stdout + client.stderr
    assert openssl_verify(files).returncode != 0  # not a server certificate
    assert cc.plan(*files.values(), ["node2"], renew_days=30, usage="client").reasons == []
    assert cc.plan(*files.values(), ["node2"], renew_days=30, usage="server").reasons == [
        f"re-issue {files['cert']}: not a server certificate"]


def test_the_ca_alone_for_a_role_that_only_verifies_and_then_a_certificate_it_signs(tmp_path: Path) -> None:
    files = store_files(tmp_path / "credentials", "prometheus")
    p = cc.plan_ca(files["ca_cert"], files["ca_key"])
    assert p.reasons == [f"new cluster CA: {files['ca_cert']}"] and not p.issue
    cc.apply(p, files["ca_cert"], files["ca_key"], None, None, [], ca_common_name="test cluster CA", valid_days=90)
    assert files["ca_cert"].is_file() and not files["key"].exists() and not files["cert"].exists()
    assert cc.plan_ca(files["ca_cert"], files["ca_key"]).reasons == []
    assert plan(files).reasons == [f"new server key: {files['key']}", f"new server certificate for "
                                   f"{', '.join(NAMES)}: {files['cert']}"]  # the same CA signs it
