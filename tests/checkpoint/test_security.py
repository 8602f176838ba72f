"""Checkpoints from shared storage as an attacker or an unlucky operator leaves them: planted pickles never run,
unsigned, re-signed-by-someone-else and tampered manifests are refused, malformed manifests are invalid (never a
crash) in verify, ls, resume and export, and the signing key never leaks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import pickle
import shlex
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from shardstack.cli import main as cli
from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, load_signing_key, sign
from shardstack.train.checkpoint.layout import (
    MANIFEST,
    MANIFEST_FORMAT,
    list_checkpoints,
    list_quarantined,
    verify_checkpoint,
)
from shardstack.train.export import export_checkpoint

from .conftest import AppState, make_checkpointer, write_key

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCommand:
    """Unpickling this runs `touch <marker>`: what an attacker plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _save(root: Path, key_file: Path | None, steps: int = 4) -> AppState:
    app = AppState()
    ckpt = make_checkpointer(root, key_file, interval=2, keep=0)
    for _ in range(steps):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    return app


def _rehash(step_dir: Path, key: SigningKey | None = None, edit=None) -> dict[str, Any]:
    """Update the manifest's sizes, sha256 and total to the files as they are now (anyone with write access can),
    apply `edit`, and re-sign only when given the key (which an attacker does not have)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (step_dir / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    if edit is not None:
        manifest = edit(manifest)
    if key is not None:
        manifest = sign({k: v for k, v in manifest.items() if k != "signature"}, key)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli(list(argv))
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "Traceback" not in out, out
    return rc, out


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_a_planted_metadata_pickle_never_runs_and_the_checkpoint_is_refused(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    signed: bool,
) -> None:
    """The issue's attack: `.metadata` replaced by a pickle that runs a command, the manifest's size and sha256
    updated to match. On main `checkpoint verify` called it fine and the next resume ran the command."""
    root, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    _save(root, key_file if signed else None)
    step = root / "step_00000004"
    (step / ".metadata").write_bytes(pickle.dumps(RunsCommand(marker)))
    _rehash(step)
    keys = ["--key-file", str(key_file)] if signed else ["--allow-unsigned"]
    why = ("signature mismatch: the manifest was changed after it was signed" if signed else
           "DCP .metadata is not checkpoint metadata: it references posix.system, which checkpoint metadata never "
           "holds")

    rc, out = _cli(capsys, "checkpoint", "verify", str(root), *keys)
    assert rc == 1 and f"INVALID: {why}" in out and "resume: auto would use step 2" in out
    rc, out = _cli(capsys, "checkpoint", "ls", str(root), *keys)  # sizes only: never reads .metadata
    assert rc == 0 and (f"INVALID: {why}" in out if signed else "ok (signature not checked, sizes)" in out)
    rc, out = _cli(capsys, "export", "--checkpoint", str(step), "--out", str(tmp_path / "o1"), *keys)
    assert rc == 2 and f"checkpoint {step} is not valid: {why}" in out
    rc, out = _cli(capsys, "export", "--no-verify", "--checkpoint", str(step), "--out", str(tmp_path / "o2"), *keys)
    assert rc == 2 and ("signature mismatch" in out if signed else "references posix.system" in out)
    rc, out = _cli(capsys, "export", "--checkpoint", str(root), "--out", str(tmp_path / "o3"), *keys)
    assert rc == 0 and "exported step 2" in out  # a root: the newest valid checkpoint
    assert not marker.exists()

    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        assert make_checkpointer(root, key_file if signed else None).resume(AppState(seed=1)) == 2
    assert f"skipping checkpoint {step}: {why}" in caplog.text
    assert [(s, r) for s, r, _ in list_quarantined(root)] == [(4, "signature-mismatch" if signed else "bad-metadata")]
    assert not marker.exists()


def test_a_planted_pickle_in_a_shard_never_runs(
    tmp_path: Path, key_file: Path, key: SigningKey, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-tensor items live inside the .distcp shards and DCP's default planner unpickles them freely. An attacker
    writes a complete, well-formed checkpoint whose `step` item runs a command; without a signature (the only way
    past verification) the load refuses it."""
    root, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    app = _save(root, None)
    step = root / "step_00000006"
    evil = {**app.state_dict(), "step": RunsCommand(marker)}
    dcp.save(evil, checkpoint_id=str(step))
    manifest = json.loads((root / "step_00000004" / MANIFEST).read_text())
    manifest.update(step=6, files={n: {"size": 0, "sha256": "0" * 64} for n in os.listdir(step)})
    (step / MANIFEST).write_text(json.dumps(manifest))
    _rehash(step)
    assert verify_checkpoint(step, key=None).valid  # well-formed, hashes right: only the load can tell
    with pytest.raises(ShardstackError, match=r"cannot load checkpoint .*step_00000006: the checkpoint item 'step' "
                                              r"is not plain data: .*GLOBAL posix\.system"):
        make_checkpointer(root, None).resume(AppState(seed=1))
    assert not marker.exists()
    # A job that requires signatures never gets that far: it is an unsigned checkpoint, quarantined.
    assert make_checkpointer(root, key_file).resume(AppState(seed=1)) == 0  # 2 and 4 are unsigned too
    assert [r for _, r, _ in list_quarantined(root)] == ["unsigned", "unsigned", "unsigned"]
    assert not marker.exists()


def test_a_tampered_manifest_is_refused_and_resume_falls_back_to_the_newest_valid(
    tmp_path: Path, key_file: Path, key: SigningKey, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    _save(root, key_file, steps=6)
    manifest = json.loads((root / "step_00000006" / MANIFEST).read_text())
    manifest["job_config"]["model"]["d_model"] = 64  # what export would build
    (root / "step_00000006" / MANIFEST).write_text(json.dumps(manifest))
    info = verify_checkpoint(root / "step_00000006", key=key)
    assert str(info.problem) == "signature mismatch: the manifest was changed after it was signed"
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        assert make_checkpointer(root, key_file).resume(AppState(seed=1)) == 4
    assert "quarantined step_00000006 as step_00000006.invalid-signature-mismatch" in caplog.text


def test_unsigned_checkpoints_are_refused_by_a_job_that_requires_signatures(
    tmp_path: Path, key_file: Path, key: SigningKey, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        _save(root, None)
    assert "checkpoint.require_signature is false" in caplog.text and "UNSIGNED" in caplog.text
    assert "signature" not in json.loads((root / "step_00000004" / MANIFEST).read_text())
    assert verify_checkpoint(root / "step_00000004", key=None).valid
    assert str(verify_checkpoint(root / "step_00000004", key=key).problem) == (
        "unsigned checkpoint: manifest.json has no signature")
    assert make_checkpointer(root, key_file).resume(AppState(seed=1)) == 0
    assert [(s, r) for s, r, _ in list_quarantined(root)] == [(2, "unsigned"), (4, "unsigned")]


def test_checkpoints_signed_with_another_key_are_skipped_but_kept_and_never_started_over(
    tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    """A wrong or rotated key is a configuration problem, not damage: nothing is quarantined, an older checkpoint
    signed with this key is resumed, and with none the job stops instead of training from 0 on top of them."""
    root = tmp_path / "ckpt"
    other_file = write_key(tmp_path / "other.key")
    other = load_signing_key(other_file)
    _save(root, other_file)
    info = verify_checkpoint(root / "step_00000004", key=key)
    assert info.problem is not None and info.problem.reason == "other-key"
    assert str(info.problem) == (f"signed with another key (key id {other.key_id}; the key at {key_file} has key id "
                                 f"{key.key_id})")
    with pytest.raises(ShardstackError, match=r"no checkpoint under .* is signed with this job's key, and 2 are "
                                              r"signed with another: signed with another key"):
        make_checkpointer(root, key_file).resume(AppState(seed=1))
    assert [s for s, _ in list_checkpoints(root)] == [2, 4] and list_quarantined(root) == []
    shutil.rmtree(root / "step_00000004")
    app = _save(root / "mine", key_file, steps=2)  # step 2 signed with this job's key, beside the other's 4
    shutil.rmtree(root / "step_00000002")
    shutil.move(root / "mine" / "step_00000002", root / "step_00000002")
    _save(root / "theirs", other_file)
    shutil.move(root / "theirs" / "step_00000004", root / "step_00000004")
    resumed = AppState(seed=3)
    assert make_checkpointer(root, key_file).resume(resumed) == 2 and resumed.step == app.step
    assert [s for s, _ in list_checkpoints(root)] == [2, 4] and list_quarantined(root) == []


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (None, 0o400, r"no signing key at {path}"),
        ("x" * 40, 0o644, r"the checkpoint signing key {path} is accessible to other accounts \(mode 0644\)"),
        ("0123456789", 0o400, r"the checkpoint signing key {path} is too short \(10 bytes; at least 32\)"),
        ("dir", 0o700, r"the checkpoint signing key {path} is not a regular file"),
    ],
    ids=["missing", "world-readable", "too-short", "directory"],
)
def test_a_bad_key_file_is_a_clear_error_before_anything_is_read_or_written(
    tmp_path: Path, content: str | None, mode: int, message: str
) -> None:
    path = tmp_path / "etc" / "checkpoint.key"
    path.parent.mkdir()
    if content == "dir":
        path.mkdir(mode=mode)
    elif content is not None:
        write_key(path, content, mode)
    with pytest.raises(ShardstackError, match=message.format(path=path)) as err:
        make_checkpointer(tmp_path / "ckpt", path)
    assert "checkpoint.signing_key_file" in str(err.value) and "require_signature: false" in str(err.value)
    assert not (tmp_path / "ckpt").exists()


def test_the_key_must_not_live_on_the_checkpoint_storage(tmp_path: Path) -> None:
    key_path = write_key((tmp_path / "ckpt").mkdir() or tmp_path / "ckpt" / "checkpoint.key")
    with pytest.raises(ShardstackError, match=r"lies under checkpoint\.dir: whoever can write checkpoints could read"):
        make_checkpointer(tmp_path / "ckpt", key_path)


def test_the_key_never_reaches_a_log_a_message_or_the_checkpoint(
    tmp_path: Path, key_file: Path, key: SigningKey, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "ckpt"
    with caplog.at_level(logging.DEBUG):
        _save(root, key_file)
        make_checkpointer(root, key_file).resume(AppState(seed=1))
        _cli(capsys, "checkpoint", "verify", str(root), "--key-file", str(key_file), "--json")
    secret = key.secret
    assert secret.decode() not in caplog.text and secret.decode() not in repr(key)
    for f in root.rglob("*"):
        if f.is_file():
            assert secret not in f.read_bytes(), f
            assert hashlib.sha256(secret).hexdigest().encode() not in f.read_bytes(), f


def _files(m: dict) -> dict:
    return m["files"]


MALFORMED: list[tuple[str, Any, str]] = [
    ("entry-not-object", lambda m: {**m, "files": {**_files(m), "__0_0.distcp": 5}},
     "files['__0_0.distcp'] is not an object with size and sha256"),
    ("size-string", lambda m: {**m, "files": {**_files(m), "__0_0.distcp": {**_files(m)["__0_0.distcp"],
                                                                              "size": "12"}}},
     "files['__0_0.distcp'].size is not a byte count"),
    ("size-bool", lambda m: {**m, "files": {**_files(m), "__0_0.distcp": {**_files(m)["__0_0.distcp"],
                                                                            "size": True}}},
     "files['__0_0.distcp'].size is not a byte count"),
    ("sha256-not-hex", lambda m: {**m, "files": {**_files(m), "__0_0.distcp": {**_files(m)["__0_0.distcp"],
                                                                                 "sha256": "z" * 64}}},
     "files['__0_0.distcp'].sha256 is not a hex sha256"),
    ("absolute-name", lambda m: {**m, "files": {**_files(m), "/etc/passwd": _files(m)["__0_0.distcp"]}},
     "file name '/etc/passwd' is neither .metadata nor a DCP shard"),
    ("dotdot-name", lambda m: {**m, "files": {**_files(m), "../step_00000002/__0_0.distcp":
                                              _files(m)["__0_0.distcp"]}},
     "file name '../step_00000002/__0_0.distcp' is neither"),
    ("nested-name", lambda m: {**m, "files": {**_files(m), "sub/__0_0.distcp": _files(m)["__0_0.distcp"]}},
     "file name 'sub/__0_0.distcp' is neither"),
    ("no-metadata", lambda m: {**m, "files": {k: v for k, v in _files(m).items() if k != ".metadata"},
                               "total_bytes": _files(m)["__0_0.distcp"]["size"]},
     "it lists no DCP .metadata file"),
    ("files-list", lambda m: {**m, "files": list(_files(m))}, "files is list"),
    ("step-string", lambda m: {**m, "step": "4"}, "step is str"),
    ("world-size-bool", lambda m: {**m, "world_size": True}, "world_size is bool"),
    ("missing-key", lambda m: {k: v for k, v in m.items() if k != "config_hash"}, "missing config_hash"),
    ("unknown-key", lambda m: {**m, "extra": 1}, "unexpected key 'extra'"),
    ("total-bytes", lambda m: {**m, "total_bytes": m["total_bytes"] + 1},
     "total_bytes is not the sum of the file sizes"),
]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Path:
    root = tmp_path_factory.mktemp("template") / "ckpt"
    _save(root, key_file)
    return root


@pytest.mark.parametrize(("edit", "problem"), [(e, p) for _, e, p in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_a_malformed_manifest_is_invalid_everywhere_never_a_crash(
    template: Path, tmp_path: Path, key_file: Path, key: SigningKey, capsys: pytest.CaptureFixture[str],
    edit, problem: str,
) -> None:
    """Signed with the cluster's key (so only the structure is wrong): verify, ls, export and resume all call it
    invalid, and resume falls back to step 2."""
    root = shutil.copytree(template, tmp_path / "ckpt")
    step = root / "step_00000004"
    _rehash(step, key, edit)
    why = f"malformed manifest.json: {problem}"
    assert problem in str(verify_checkpoint(step, key=key).problem)
    for action in ("ls", "verify"):
        rc, out = _cli(capsys, "checkpoint", action, str(root), "--key-file", str(key_file))
        assert rc == (0 if action == "ls" else 1) and why in out, out
    rc, out = _cli(capsys, "export", "--checkpoint", str(step), "--out", str(tmp_path / "out"), "--key-file",
                   str(key_file))
    assert rc == 2 and why in out
    assert make_checkpointer(root, key_file).resume(AppState(seed=1)) == 2
    assert [(s, r) for s, r, _ in list_quarantined(root)] == [(4, "bad-manifest")]


@pytest.mark.parametrize(
    ("damage", "problem", "reason"),
    [
        (lambda d: (d / MANIFEST).write_text("[1, 2]"), "malformed manifest.json: not a JSON object", "bad-manifest"),
        (lambda d: (d / MANIFEST).write_text(json.dumps({**json.loads((d / MANIFEST).read_text()),
                                                         "format": "shardstack-checkpoint/1"})),
         f"manifest.json is format 'shardstack-checkpoint/1'; this shardstack reads {MANIFEST_FORMAT}",
         "unsupported-format"),
        # DCP falls back to a rank-local __<rank>.metadata when .metadata fails to load: one planted beside a
        # signed checkpoint is refused before anything reads it.
        (lambda d: (d / "__0.metadata").write_bytes(pickle.dumps(RunsCommand(d.parent.parent / "PWNED"))),
         "unlisted file __0.metadata (not in the manifest)", "unlisted-file"),
        # A signed older checkpoint replayed under a newer step's name.
        (lambda d: (shutil.rmtree(d), shutil.copytree(d.parent / "step_00000002", d)),
         "manifest.json says step 2 but the directory is step_00000004", "step-mismatch"),
    ],
    ids=["not-an-object", "old-format", "planted-rank-local-metadata", "replayed-step"],
)
def test_other_invalid_checkpoints_are_refused_with_their_reason(
    template: Path, tmp_path: Path, key: SigningKey, key_file: Path, damage, problem: str, reason: str
) -> None:
    root = shutil.copytree(template, tmp_path / "ckpt")
    damage(root / "step_00000004")
    assert str(verify_checkpoint(root / "step_00000004", key=key).problem) == problem
    assert make_checkpointer(root, key_file).resume(AppState(seed=1)) == 2
    assert [(s, r) for s, r, _ in list_quarantined(root)] == [(4, reason)]
    assert not (tmp_path / "PWNED").exists()


def test_export_through_the_library_checks_the_signature(template: Path, tmp_path: Path, key: SigningKey) -> None:
    root = shutil.copytree(template, tmp_path / "ckpt")
    _rehash(root / "step_00000004", edit=lambda m: {**m, "config_hash": "f00d"})
    with pytest.raises(ShardstackError, match="signature mismatch"):
        export_checkpoint(root / "step_00000004", tmp_path / "out", key=key)
    assert export_checkpoint(root, tmp_path / "out", key=key).step == 2


class _ByName(pickle.Pickler):
    """Pickles enum members as `getattr(cls, name)`, as Debian 12's Python 3.11.2 does (later 3.11s: `cls(value)`)."""

    def __init__(self, f: Any, target: Any = None) -> None:
        super().__init__(f)
        self.target = target

    def reducer_override(self, obj: Any) -> Any:
        import enum

        if isinstance(obj, enum.Enum):
            return (getattr, (self.target or type(obj), obj.name))
        return NotImplemented


@pytest.mark.parametrize("target", ["enum", "other"])
def test_metadata_from_a_python_that_pickles_enums_by_name(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """A node's checkpoint is read on the controller whatever 3.11 wrote it; getattr on anything else is refused."""
    import io

    root = tmp_path / "ckpt"
    _save(root, key_file)
    step = root / "step_00000004"
    md = dcp.FileSystemReader(str(step)).read_metadata()
    buf = io.BytesIO()
    _ByName(buf, target=pathlib.PosixPath if target == "other" else None).dump(md)
    assert b"getattr" in buf.getvalue()
    (step / ".metadata").write_bytes(buf.getvalue())
    _rehash(step, load_signing_key(key_file))  # as the key holder would: only the pickle form differs
    rc, out = _cli(capsys, "checkpoint", "verify", str(root), "--key-file", str(key_file))
    if target == "enum":
        assert rc == 0 and "INVALID" not in out, out
    else:
        assert rc == 1 and "calls getattr on something other than a checkpoint metadata enum member" in out, out


def test_metadata_from_python_3_13_names_posixpath_by_its_new_module(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python 3.13 (Debian 13's nodes) pickles StorageMeta's checkpoint_id as pathlib._local.PosixPath: a trixie
    node's checkpoint resumes and exports (found when the first trixie lab's export refused its own checkpoint)."""
    root = tmp_path / "ckpt"
    _save(root, key_file)
    step = root / "step_00000004"
    md = dcp.FileSystemReader(str(step)).read_metadata()
    data = pickle.dumps(md, protocol=2)  # GLOBAL opcodes name the module as text
    assert b"cpathlib\nPosixPath\n" in data
    (step / ".metadata").write_bytes(data.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n"))
    _rehash(step, load_signing_key(key_file))
    rc, out = _cli(capsys, "checkpoint", "verify", str(root), "--key-file", str(key_file))
    assert rc == 0 and "INVALID" not in out, out
    rc, out = _cli(capsys, "export", "--checkpoint", str(root), "--out", str(tmp_path / "o"),
                   "--key-file", str(key_file))
    assert rc == 0 and "exported step 4" in out, out


def _set_acl(path: Path, *entries: tuple[int, int, int]) -> None:
    """A POSIX access ACL as setfacl writes it (version 2, then (tag, perm, id) entries in tag order)."""
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in sorted(entries)))


USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF


@pytest.mark.parametrize(
    ("named", "ok"),
    [((USER, 4, "self"), True), ((USER, 4, 65534), False), ((GROUP, 4, 65534), False)],
    ids=["this-account", "another-user", "a-group"],
)
def test_a_key_shared_by_acl_only_with_this_account_loads(tmp_path: Path, named: tuple, ok: bool) -> None:
    """systemd 257 (Debian 13) hands LoadCredential= files to a service's user by a named ACL entry: mode 0440, the
    group bits being the ACL's mask. That is private; an entry for anyone else is not."""
    path = write_key(tmp_path / "signing-key", "k" * 40, 0o400)
    tag, perm, ident = named
    _set_acl(path, (USER_OBJ, 4, NO_ID), (tag, perm, os.geteuid() if ident == "self" else ident),
             (GROUP_OBJ, 0, NO_ID), (MASK, 4, NO_ID), (OTHER, 0, NO_ID))
    assert path.stat().st_mode & 0o777 == 0o440
    if ok:
        assert load_signing_key(path).secret == b"k" * 40
    else:
        with pytest.raises(ShardstackError, match=r"accessible to other accounts \(mode 0440 and its ACL\)"):
            load_signing_key(path)
