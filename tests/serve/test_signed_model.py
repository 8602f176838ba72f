"""Signed exports (model.manifest): the service loads only what a manifest signed with the cluster key lists, from
the private copy it hashed while copying. Every way an export can be changed after it was signed is refused with
a line that names what changed, and the refusal leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from shardstack.errors import ShardstackError
from shardstack.model.manifest import MANIFEST, stage_verified, write_manifest
from shardstack.serve.demo import write_random_model
from shardstack.signing import SigningKey, load_signing_key


def _key(path: Path, secret: str) -> SigningKey:
    path.write_text(secret + "\n")
    path.chmod(0o400)
    return load_signing_key(path)


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, SigningKey, Path]:
    """(a signed export, its key, an empty directory to stage into)."""
    key = _key(tmp_path / "key", "k" * 40)
    model = write_random_model(tmp_path / "m", "tiny", seed=7)
    write_manifest(model, key, step=12, source="/srv/ckpt/step_00000012")
    (tmp_path / "stage").mkdir()
    return model, key, tmp_path / "stage"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_staged_copy_is_the_signed_export(signed: tuple[Path, SigningKey, Path]) -> None:
    model, key, into = signed
    (model / "notes.txt").write_text("not in the manifest")  # never copied, so never read
    staged = stage_verified(model, key, into)
    manifest = json.loads((model / MANIFEST).read_text())
    assert sorted(p.name for p in staged.path.iterdir()) == sorted(manifest["files"]) == ["config.json",
                                                                                            "model.safetensors"]
    for name, rec in manifest["files"].items():
        assert _digest(staged.path / name) == _digest(model / name) == rec["sha256"]
    assert (staged.files, staged.step, staged.key_id) == (2, 12, key.key_id)
    assert staged.bytes == sum((model / n).stat().st_size for n in manifest["files"])
    assert staged.path.parent == into and (staged.path.stat().st_mode & 0o077) == 0  # private
    # What was hashed is what is loaded: a change on the shared storage afterwards does not reach the copy.
    before = _digest(staged.path / "model.safetensors")
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    assert _digest(staged.path / "model.safetensors") == before


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(model: Path, change) -> None:
    manifest = json.loads((model / MANIFEST).read_text())
    change(manifest)
    (model / MANIFEST).write_text(json.dumps(manifest))


TAMPERING = {
    "a weight changed": (lambda m, k: _flip_last_byte(m / "model.safetensors"),
                         "model.safetensors does not match its sha256 in the signed manifest"),
    "the config grown": (lambda m, k: (m / "config.json").write_text((m / "config.json").read_text() + " "),
                         "config.json is larger, the signed manifest says"),
    "weights truncated": (lambda m, k: os.truncate(m / "model.safetensors", 100),
                          "model.safetensors is 100 bytes, the signed manifest says"),
    "a file removed": (lambda m, k: (m / "config.json").unlink(), "config.json is missing"),
    "a file replaced by a link": (lambda m, k: ((m / "config.json").unlink(),
                                                (m / "config.json").symlink_to("/etc/hostname")),
                                  "cannot open config.json: Too many levels of symbolic links"),
    "the manifest's hashes rewritten": (
        lambda m, k: _edit_manifest(m, lambda d: d["files"]["model.safetensors"].update(sha256="0" * 64)),
        "signature mismatch: the manifest was changed after it was signed"),
    "signed with another key": (lambda m, k: write_manifest(m, _key(m.parent / "other", "o" * 40), step=1,
                                                            source="x"), "signed with another key"),
    "unsigned": (lambda m, k: write_manifest(m, None, step=1, source="x"),
                 "unsigned export: manifest.json has no signature"),
    "no manifest": (lambda m, k: (m / MANIFEST).unlink(), "has no manifest.json"),
    "not a manifest": (lambda m, k: (m / MANIFEST).write_text('{"files": []}'),
                       "manifest.json is not the manifest of a shardstack export"),
    "a path outside the directory": (
        lambda m, k: write_manifest(m, k, step=1, source="x") and _edit_and_resign(m, k),
        "bad entry '../key'"),
}


def _edit_and_resign(model: Path, key: SigningKey) -> None:
    from shardstack.signing import sign

    manifest = json.loads((model / MANIFEST).read_text())
    manifest["files"]["../key"] = {"size": 1, "sha256": "0" * 64}
    (model / MANIFEST).write_text(json.dumps(sign(manifest, key)))


@pytest.mark.parametrize("case", TAMPERING)
def test_a_changed_export_is_refused_and_nothing_is_left(signed: tuple[Path, SigningKey, Path], case: str) -> None:
    model, key, into = signed
    tamper, message = TAMPERING[case]
    tamper(model, key)
    with pytest.raises(ShardstackError) as err:
        stage_verified(model, key, into)
    assert message in str(err.value) and str(model) in str(err.value)
    assert "re-export" in str(err.value)  # the hint says what to do
    assert list(into.iterdir()) == []


def test_serve_refuses_a_changed_export_in_one_line(signed: tuple[Path, SigningKey, Path]) -> None:
    # What the deployed unit runs (--key-file from LoadCredential=): no READY, a non-zero exit, one clear line.
    model, key, into = signed
    _flip_last_byte(model / "model.safetensors")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run([sys.executable, "-m", "shardstack", "serve", "--model", str(model), "--port", port,
                           "--key-file", str(key.path), "--stage-dir", str(into), "--threads", "1"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "cannot serve" in ln]
    assert len(lines) == 1 and "model.safetensors does not match its sha256 in the signed manifest" in lines[0]
    assert "Traceback" not in proc.stderr and list(into.iterdir()) == []


def test_serve_needs_the_key_or_an_explicit_opt_out(tmp_path: Path) -> None:
    model = write_random_model(tmp_path / "m", "tiny")
    proc = subprocess.run([sys.executable, "-m", "shardstack", "serve", "--model", str(model),
                           "--key-file", str(tmp_path / "nokey")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"no signing key at {tmp_path / 'nokey'}" in proc.stderr
    assert "--allow-unsigned" in proc.stderr and "Traceback" not in proc.stderr


def test_a_stage_directory_that_cannot_hold_the_copy_is_a_clear_error(signed: tuple[Path, SigningKey, Path]) -> None:
    model, key, into = signed
    not_a_dir = into / "file"
    not_a_dir.write_text("")
    with pytest.raises(ShardstackError) as err:
        stage_verified(model, key, not_a_dir)
    assert f"cannot make the private copy of {model} in {not_a_dir}: Not a directory" in str(err.value)
    assert "--stage-dir must be a writable directory" in str(err.value)


def test_a_named_copy_has_the_exports_name_while_it_is_free_and_leaves_the_rest(
        signed: tuple[Path, SigningKey, Path]) -> None:
    """vLLM's single-node staging: the same export gets the same path at every start (its torch.compile cache is
    keyed on it), nothing else in the directory is touched, and a second process on the same export while the first
    holds the name gets a private copy instead of taking the first one's."""
    model, key, into = signed
    (into / "unrelated").write_text("kept")
    first = stage_verified(model, key, into, named=True)
    assert first.path.parent == into and first.path.name.startswith("shardstack-model-")
    second = stage_verified(model, key, into, named=True)
    assert second.path != first.path and second.path.name.startswith("shardstack-model-")
    assert (first.path / "model.safetensors").stat().st_size == (second.path / "model.safetensors").stat().st_size
    shutil.rmtree(first.path)  # the first server ended (vllm.run removes its copy)
    assert stage_verified(model, key, into, named=True).path == first.path
    assert (into / "unrelated").read_text() == "kept" and second.path.is_dir()
    assert not list(into.glob(".staging-*"))


def test_another_step_of_the_same_model_is_staged_at_the_same_path(signed: tuple[Path, SigningKey, Path],
                                                                   tmp_path: Path) -> None:
    """A rollout to another export of the same architecture loads the same path, so vLLM's compile cache entry
    (keyed on path and config, not on the weights) is used; another architecture gets another path."""
    model, key, into = signed
    first = stage_verified(model, key, into, named=True)
    shutil.rmtree(first.path)
    later = shutil.copytree(model, tmp_path / "later")  # the same config.json, other weights
    _flip_last_byte(later / "model.safetensors")
    write_manifest(later, key, step=24, source="/srv/ckpt/step_00000024")
    assert _digest(later / "model.safetensors") != _digest(model / "model.safetensors")
    staged = stage_verified(later, key, into, named=True)
    assert staged.path == first.path and staged.step == 24
    assert _digest(staged.path / "model.safetensors") == _digest(later / "model.safetensors")
    shutil.rmtree(staged.path)
    config = json.loads((later / "config.json").read_text())
    (later / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "n_layer": 3}}))
    write_manifest(later, key, step=36, source="/srv/ckpt/step_00000036")
    assert stage_verified(later, key, into, named=True).path != first.path


def test_every_node_of_a_pipeline_stages_the_export_at_the_same_path(signed: tuple[Path, SigningKey, Path],
                                                                     tmp_path: Path) -> None:
    """Pipeline parallel: vLLM's workers on the other nodes load the head's --model path, so each node's verified
    copy is named after the signed manifest; `serve stage` (the Ray worker units' start) and the head's own staging
    agree, and a node keeps one copy: the export's it staged last."""
    model, key, into = signed
    (into / "shardstack-model-0123456789abcdef").mkdir()  # an earlier export's copy
    proc = subprocess.run([sys.executable, "-m", "shardstack", "serve", "stage", "--model", str(model),
                           "--key-file", str(key.path), "--into", str(into)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    worker = Path(proc.stdout.strip())
    head_into = tmp_path / "head"
    head_into.mkdir()
    head = stage_verified(model, key, head_into, shared_name=True)
    assert head.path.name == worker.name and worker.parent == into and list(into.iterdir()) == [worker]
    manifest = json.loads((model / MANIFEST).read_text())
    for name, rec in manifest["files"].items():
        assert _digest(worker / name) == rec["sha256"]
    # Staged again (a restart), the copy is replaced in place; a private copy keeps its random name.
    assert stage_verified(model, key, into, shared_name=True).path == worker and list(into.iterdir()) == [worker]
    assert stage_verified(model, key, head_into).path.name != worker.name
    # A changed export is refused by `serve stage` too, in one line, before the Ray node starts.
    _flip_last_byte(model / "model.safetensors")
    bad = subprocess.run([sys.executable, "-m", "shardstack", "serve", "stage", "--model", str(model),
                          "--key-file", str(key.path), "--into", str(into)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "does not match its sha256" in bad.stderr and "Traceback" not in bad.stderr
