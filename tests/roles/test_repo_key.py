"""shardstack_common's repo_key.yml run for real on this machine (ansible-runner, local connection): a signing key is
kept only when every primary key in it has a pinned fingerprint; otherwise the file is removed and the play fails
naming what was served. Keys are made with gpg for each test and served as file:// URLs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_vars import load_module
from shardstack.ops.runner import run_playbook

ROLES = Path(__file__).resolve().parents[2] / "roles"


def _key(home: Path, name: str) -> tuple[bytes, str]:
    """A fresh signing key (ed25519, no passphrase): its armored public key and its fingerprint."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {**os.environ, "GNUPGHOME": str(home)}
    subprocess.run(["gpg", "-q", "--batch", "--passphrase", "", "--quick-gen-key", f"{name} <{name}@example.org>",
                    "ed25519", "sign", "never"], env=env, check=True, capture_output=True)
    armored = subprocess.run(["gpg", "--armor", "--export", f"{name}@example.org"], env=env, check=True,
                             capture_output=True).stdout
    colons = subprocess.run(["gpg", "--with-colons", "--list-keys", f"{name}@example.org"], env=env, check=True,
                            capture_output=True, text=True).stdout
    return armored, next(line.split(":")[9] for line in colons.splitlines() if line.startswith("fpr:"))


def _run(tmp_path: Path, served: bytes, pins: list[str]):
    src, dest = tmp_path / "served.asc", tmp_path / "keyrings" / "repo.asc"
    src.write_bytes(served)
    dest.parent.mkdir(exist_ok=True)
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir(exist_ok=True)
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {}}, "vars": {
        # The system Python: the role's apt task needs python3-apt in the interpreter (Mitogen runs it there).
        "ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}}}))
    res = run_playbook("tests/ops/playbooks/repo_key.yml", inv, artifacts=tmp_path / "art", extravars={
        "__shardstack_common_key_url": src.as_uri(), "__shardstack_common_key_path": str(dest),
        "__shardstack_common_key_fingerprints": pins})
    return res, dest


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bytes, str]]:
    home = tmp_path_factory.mktemp("gnupg")
    return {name: _key(home / name, name) for name in ("publisher", "intruder")}


def test_a_pinned_key_is_kept_and_a_rerun_changes_nothing(tmp_path: Path, keys: dict) -> None:
    armored, fpr = keys["publisher"]
    # Pins are compared without case or the spaces fingerprints are often printed with.
    spaced = " ".join(fpr[i:i + 4] for i in range(0, 40, 4)).lower()
    first, dest = _run(tmp_path, armored, [spaced])
    assert first.success, {h: (r.failed_task, r.message) for h, r in first.hosts.items()}
    assert dest.read_bytes() == armored and oct(dest.stat().st_mode & 0o777) == "0o644"
    again, _ = _run(tmp_path, armored, [fpr])
    assert again.success and again.changed == 0


# "both": the publisher's key with another primary key appended, which apt would trust as well.
@pytest.mark.parametrize("served", ["both", "not a key"])
def test_a_key_that_is_not_pinned_is_removed_and_fails_the_play(tmp_path: Path, keys: dict, served: str) -> None:
    body = {"both": keys["publisher"][0] + keys["intruder"][0], "not a key": b"<html>captive portal</html>\n"}[served]
    res, dest = _run(tmp_path, body, [keys["publisher"][1]])
    assert not res.success
    failed = next(r for r in res.hosts.values() if not r.success)
    assert failed.failed_task == "Repository key - stop before anything trusts it"
    assert ("none (not an OpenPGP key)" if served == "not a key" else keys["intruder"][1]) in failed.message
    assert not dest.exists()


def test_primary_fingerprints_skip_subkeys() -> None:
    filters = load_module(ROLES / "shardstack_common" / "filter_plugins" / "shardstack_common.py")
    lines = ["pub:-:255:22:AAAA:1::-:::scSC:::::ed25519:::0:", "fpr:::::::::" + "a" * 40 + ":",
             "uid:-::::1::X::n <n@x>::::::::::0:", "sub:-:255:18:BBBB:1::::::e:::::cv25519::",
             "fpr:::::::::" + "B" * 40 + ":", "pub:-:4096:1:CCCC:1::-:::scSC::::::::0:",
             "fpr:::::::::" + "C" * 40 + ":"]
    assert filters.gpg_primary_fingerprints(lines) == ["A" * 40, "C" * 40]


def test_the_cuda_repository_trusts_only_its_pinned_key_on_both_families() -> None:
    """No RHEL node here to run it on: what cuda_repo.yml declares. On each family the key comes through
    repo_key.yml with a pinned fingerprint, and the repository entry names that file as its only key."""
    common = ROLES / "shardstack_common"
    tasks = yaml.safe_load((common / "tasks" / "cuda_repo.yml").read_text())
    defaults = yaml.safe_load((common / "defaults" / "main.yml").read_text())
    internal = yaml.safe_load((common / "vars" / "main.yml").read_text())
    for family, fingerprints, key_file in (
            ("Debian", "shardstack_cuda_repo_key_fingerprints", "__shardstack_common_cuda_keyring"),
            ("RedHat", "shardstack_cuda_repo_rpm_key_fingerprints", "__shardstack_common_cuda_rpm_key")):
        mine = [t for t in tasks if f"== '{family}'" in str(t.get("when", ""))]
        key = next(t for t in mine if t.get("ansible.builtin.include_tasks") == "repo_key.yml")
        assert key["vars"]["__shardstack_common_key_fingerprints"] == "{{ " + fingerprints + " }}"
        assert key["vars"]["__shardstack_common_key_path"] == "{{ " + key_file + " }}"
        pins = defaults[fingerprints]
        assert pins and all(len(p) == 40 and int(p, 16) for p in pins), pins
        repo = next(t for t in mine if {"ansible.builtin.apt_repository", "ansible.builtin.yum_repository"} & set(t))
        entry = repo.get("ansible.builtin.apt_repository") or repo["ansible.builtin.yum_repository"]
        if family == "Debian":
            assert entry["repo"].startswith("deb [signed-by={{ " + key_file + " }}] ")
        else:
            assert entry["gpgkey"] == "file://{{ " + key_file + " }}"
            assert entry["gpgcheck"] is True and entry["repo_gpgcheck"] is True
        assert mine.index(key) < mine.index(repo)  # the key is checked before anything trusts it
        assert internal[key_file].startswith("/etc/")
    # Nothing fetched from the repository is trusted unverified: no keyring package, no .repo file download.
    assert not any("ansible.builtin.get_url" in t for t in tasks)
