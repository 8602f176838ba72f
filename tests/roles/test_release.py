"""shardstack_common's release.yml run for real on this machine (ansible-runner, local connection): a release tarball
built here, served as a file:// URL with its real sha256, is downloaded, verified, unpacked and its executables
linked, all under tmp_path; the service user is a throwaway one, removed again. Nothing under /opt, /usr/local/bin
or /var/cache/shardstack is touched."""

from __future__ import annotations

import grp
import hashlib
import io
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardstack.ops.runner import RunResult, run_playbook

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creates a system user and root-owned files on this machine")

# Two releases as the prometheus role has them: one with two executables (the first marks it unpacked), one with one.
RELEASES = {"demo-1.2.3.linux-amd64": ["demo", "demotool"], "helper-0.4.0.linux-amd64": ["helper"]}


def _tarball(path: Path, top: str, executables: list[str]) -> str:
    """A release tarball holding `<top>/<executable>` shell scripts that print their name; its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for name in executables:
            body = f"#!/bin/sh\necho {name} from {top}\n".encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(body), 0o755
            tar.addfile(info, io.BytesIO(body))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def user() -> Iterator[str]:
    """A throwaway service user name; the user and its group are removed again whatever the test did."""
    name = f"ssrel-{secrets.token_hex(4)}"
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    with pytest.raises(KeyError):
        grp.getgrnam(name)


@pytest.fixture
def served(tmp_path: Path) -> list[dict[str, Any]]:
    """The releases, built in tmp_path/served and described as release.yml takes them."""
    src = tmp_path / "served"
    src.mkdir()
    out = []
    for top, executables in RELEASES.items():
        tarball = src / f"{top}.tar.gz"
        out.append({"url": tarball.as_uri(), "checksum": f"sha256:{_tarball(tarball, top, executables)}",
                    "dir": top, "executables": executables})
    return out


def _run(tmp_path: Path, user: str, releases: list[dict[str, Any]], *, check: bool = False,
         run: str = "run") -> tuple[RunResult, dict[str, Path]]:
    """release.yml with its unpack root, link and download directories (and the user's home) under tmp_path."""
    paths = {"root": tmp_path / "opt", "bin": tmp_path / "bin", "cache": tmp_path / "cache" / "demo",
             "home": tmp_path / "home"}
    paths["root"].mkdir(exist_ok=True)  # as /opt and /usr/local/bin are there on a node
    paths["bin"].mkdir(exist_ok=True)
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir(exist_ok=True)
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {}}, "vars": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    res = run_playbook("tests/roles/playbooks/release.yml", inv, artifacts=tmp_path / f"art-{run}", check=check,
                       extravars={
                           "__shardstack_common_release_user": user,
                           "__shardstack_common_release_home": str(paths["home"]),
                           "__shardstack_common_releases": releases,
                           "__shardstack_common_release_cache": str(paths["cache"]),
                           "__shardstack_common_release_notify": ["release test restart"],
                           "__shardstack_common_release_root": str(paths["root"]),
                           "__shardstack_common_release_bin_dir": str(paths["bin"])})
    return res, paths


def _why(res: RunResult) -> dict[str, tuple[str | None, str | None]]:
    return {h: (r.failed_task, r.message) for h, r in res.hosts.items()}


def _failed_items(res: RunResult) -> list[str]:
    """The messages of the loop items that failed (the host's message is only "One or more items failed")."""
    events = (json.loads(p.read_text()) for p in Path(res.artifact_dir).glob("job_events/*.json"))
    return [e["event_data"]["res"].get("msg", "") for e in events if e.get("event") == "runner_item_on_failed"]


def test_a_release_is_unpacked_and_linked_once(tmp_path: Path, user: str, served: list[dict[str, Any]]) -> None:
    """Also over what an older version left: a link elsewhere and a plain file at a link's path are replaced."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "demo").symlink_to("/nonexistent/demo-1.0.0/demo")
    (bin_dir / "helper").write_text("old\n")
    first, paths = _run(tmp_path, user, served, run="first")
    assert first.success, _why(first)
    assert first.changed > 0 and first.data.get("notified") is True  # the caller's handler ran

    account = pwd.getpwnam(user)
    assert account.pw_gid == grp.getgrnam(user).gr_gid
    assert account.pw_dir == str(paths["home"]) and account.pw_shell == "/usr/sbin/nologin"
    assert account.pw_uid < 1000 and not paths["home"].exists()  # a system user; its home is not created

    cache = paths["cache"]
    assert oct(cache.stat().st_mode & 0o777) == "0o755" and cache.stat().st_uid == 0
    for release in served:
        tarball = cache / Path(release["url"]).name
        assert oct(tarball.stat().st_mode & 0o777) == "0o644" and tarball.stat().st_uid == 0
        for name in release["executables"]:
            target = paths["root"] / release["dir"] / name
            assert target.stat().st_uid == 0 and target.stat().st_gid == 0
            link = paths["bin"] / name
            assert link.is_symlink() and os.readlink(link) == str(target)
            out = subprocess.run([str(link)], capture_output=True, text=True, check=True).stdout
            assert out == f"{name} from {release['dir']}\n"
    assert sorted(p.name for p in paths["bin"].iterdir()) == sorted(n for r in served for n in r["executables"])

    again, _ = _run(tmp_path, user, served, run="again")
    assert again.success, _why(again)
    assert again.changed == 0 and "notified" not in again.data


def test_a_wrong_checksum_fails_and_links_nothing(tmp_path: Path, user: str, served: list[dict[str, Any]]) -> None:
    wrong = [{**served[0], "checksum": "sha256:" + "0" * 64}, *served[1:]]
    res, paths = _run(tmp_path, user, wrong)
    assert not res.success
    failed = next(r for r in res.hosts.values() if not r.success)
    assert failed.failed_task == "Release - download and verify"
    messages = _failed_items(res)
    real = served[0]["checksum"].removeprefix("sha256:")
    assert len(messages) == 1 and f"did not match {'0' * 64}; it was {real}" in messages[0], messages
    assert not any(paths["bin"].iterdir()) and not any(paths["root"].iterdir())
    assert not (paths["cache"] / Path(served[0]["url"]).name).exists()
    assert "notified" not in res.data


def test_check_mode_on_a_fresh_node_changes_nothing(tmp_path: Path, user: str, served: list[dict[str, Any]]) -> None:
    """No download directory yet: the download and the unpack are skipped, not failed."""
    res, paths = _run(tmp_path, user, served, check=True)
    assert res.success, _why(res)
    assert res.changed > 0  # what a real run would do is reported
    assert not any(paths["root"].iterdir()) and not any(paths["bin"].iterdir()) and not paths["home"].exists()
    assert not paths["cache"].parent.exists()
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    with pytest.raises(KeyError):
        grp.getgrnam(user)


def test_a_release_without_executables_is_refused(tmp_path: Path, user: str, served: list[dict[str, Any]]) -> None:
    res, paths = _run(tmp_path, user, [{**served[0], "executables": []}])
    assert not res.success
    failed = next(r for r in res.hosts.values() if not r.success)
    assert failed.failed_task == "Release - the releases are ones this file knows how to install"
    assert not any(paths["bin"].iterdir())
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
