"""The signed manifest of a model export, and the verified private copy the inference service loads.

`shardstack export` ends by writing OUT/manifest.json: the size and sha256 of every file in OUT and the checkpoint
step it came from, signed with the cluster key (shardstack.signing). Whoever can write the shared storage can change
the files and the hashes, not make a signature that verifies.

Serving verifies while it copies (`stage_verified`): the export directory is opened once (exports/current resolves
a single time, so a switch of the link midway cannot mix two exports), each file the manifest lists is opened
without following links and copied into a private directory while its bytes are hashed, and the engine loads that
copy. What was hashed is what is loaded; nothing on the shared storage can change it afterwards. Files the manifest
does not list are never copied, so they are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, sign, signature_problem

MANIFEST = "manifest.json"
KIND = "shardstack-export"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 8 << 20
_HINT = ("re-export the checkpoint with `shardstack export` on a train node (it signs with the cluster key), or "
         "serve a directory you trust with --allow-unsigned")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out: str | os.PathLike, key: SigningKey | None, *, step: int, source: str) -> dict[str, Any]:
    """Write OUT/manifest.json for the regular files in OUT (signed when `key` is given) and return it. Last step of
    an export: an export without a manifest is one that did not finish."""
    out = Path(out)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(out.iterdir()) if p.name != MANIFEST and p.is_file() and not p.is_symlink()}
    manifest: dict[str, Any] = {"kind": KIND, "version": VERSION, "step": step, "source_checkpoint": source,
                                "files": files}
    if key is not None:
        manifest = sign(manifest, key)
    tmp = out / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MANIFEST)
    return manifest


@dataclass(frozen=True)
class Staged:
    path: Path  # the private, verified copy
    files: int
    bytes: int
    step: int | None
    key_id: str


def _open_file(dfd: int, name: str, where: Path) -> int:
    """`name` in the directory `dfd`, opened read-only without following a link; a regular file or an error."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        raise ShardstackError(f"{where}: {name} is missing", hint=_HINT) from None
    except OSError as exc:
        raise ShardstackError(f"{where}: cannot open {name}: {exc.strerror}", hint=_HINT) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ShardstackError(f"{where}: {name} is not a regular file", hint=_HINT)
    return fd


def _read_manifest(dfd: int, where: Path) -> dict[str, Any]:
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        raise ShardstackError(f"{where} has no {MANIFEST}: not a finished `shardstack export`, or not signed",
                              hint=_HINT) from None
    except OSError as exc:
        raise ShardstackError(f"{where}: cannot open {MANIFEST}: {exc.strerror}", hint=_HINT) from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = json.loads(data) if len(data) <= MAX_MANIFEST_BYTES else None
    except ValueError:
        manifest = None
    if not (isinstance(manifest, dict) and manifest.get("kind") == KIND and isinstance(manifest.get("files"), dict)):
        raise ShardstackError(f"{where}/{MANIFEST} is not the manifest of a shardstack export", hint=_HINT)
    return manifest


def _listed(manifest: dict[str, Any], where: Path) -> dict[str, tuple[int, str]]:
    """{file name: (size, sha256)}: plain names in the directory itself, well-formed records."""
    out = {}
    for name, rec in manifest["files"].items():
        ok = (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name
              and "\0" not in name and isinstance(rec, dict) and isinstance(rec.get("size"), int)
              and isinstance(rec.get("sha256"), str))
        if not ok:
            raise ShardstackError(f"{where}/{MANIFEST}: bad entry {name!r}", hint=_HINT)
        out[name] = (rec["size"], rec["sha256"])
    return out


def _copy_checked(dfd: int, name: str, dest: Path, size: int, digest: str, where: Path) -> None:
    fd = _open_file(dfd, name, where)
    h, copied = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as src, open(dest, "xb") as dst:
        while chunk := src.read(_CHUNK):
            copied += len(chunk)
            if copied > size:
                break
            h.update(chunk)
            dst.write(chunk)
    if copied != size:
        raise ShardstackError(f"{where}: {name} is {'larger' if copied > size else f'{copied} bytes'}, the signed "
                              f"manifest says {size} bytes: changed after the export", hint=_HINT)
    if h.hexdigest() != digest:
        raise ShardstackError(f"{where}: {name} does not match its sha256 in the signed manifest: changed after the "
                              "export", hint=_HINT)


def stage_verified(model_dir: str | os.PathLike, key: SigningKey, into: str | os.PathLike, *,
                   shared_name: bool = False, named: bool = False) -> Staged:
    """Verify the export at `model_dir` against its manifest signed with `key`, copying what it lists into a new
    private directory under `into` (removed again if anything fails). Raises ShardstackError naming what failed.

    named: the copy is named after the export's signed config.json (the architecture, not the weights), so a restart
    on the same export or on another step of the same model loads the same path: vLLM keys its torch.compile cache
    on the model's path and config, never on the weights, and a new path means compiling the model again.
    A name another process holds leaves this copy its private one. shared_name: named after the whole signed
    manifest (the export), and it replaces whatever else is in `into` (the copies of earlier exports), so every node
    that stages the same export gets the same path (pipeline parallel: vLLM's workers on the other nodes load the
    head's --model path) and a node that staged another export has no such path: its stage fails, never serves
    the other weights."""
    where = Path(model_dir)
    try:
        dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ShardstackError(f"cannot open the model directory {where}: {exc.strerror}") from None
    try:
        manifest = _read_manifest(dfd, where)
        problem = signature_problem(manifest, key, what="export")
        if problem is not None:
            raise ShardstackError(f"{where} does not verify: {problem[1]}", hint=_HINT)
        files = _listed(manifest, where)
        try:
            dest = Path(tempfile.mkdtemp(prefix=".staging-" if shared_name or named else "shardstack-model-",
                                         dir=into))
        except OSError as exc:
            raise ShardstackError(f"cannot make the private copy of {where} in {into}: {exc.strerror}",
                                  hint="--stage-dir must be a writable directory") from None
        try:
            for name, (size, digest) in sorted(files.items()):
                _copy_checked(dfd, name, dest / name, size, digest, where)
        except OSError as exc:  # writing the copy: a full or failing stage directory, not the export
            shutil.rmtree(dest, ignore_errors=True)
            raise ShardstackError(f"cannot copy {where} into {dest}: {exc.strerror}",
                                  hint="--stage-dir needs room for the whole model while it loads") from None
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
    finally:
        os.close(dfd)
    if shared_name or named:
        config = None if shared_name else files.get("config.json")
        digest = config[1] if config else hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        final = Path(into) / f"shardstack-model-{digest[:16]}"
        for old in Path(into).iterdir() if shared_name else ():  # one model on the node's disk: this one
            if old == dest:
                continue
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        try:
            dest = dest.rename(final)
        except OSError:  # named only: the name is another process's copy (or a killed one's, left behind)
            dest = dest.rename(Path(tempfile.mkdtemp(prefix="shardstack-model-", dir=into)))
    step = manifest.get("step")
    return Staged(dest, len(files), sum(s for s, _ in files.values()), step if isinstance(step, int) else None,
                  key.key_id)
