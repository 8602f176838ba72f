"""Sharded training checkpoints: torch.distributed.checkpoint (DCP) per step directory, committed atomically.

Layout under `checkpoint.dir`::

    step_00000100/                      a committed checkpoint: DCP shards (__<rank>_<n>.distcp), .metadata,
                                        manifest.json (signed)
    step_00000200.tmp-1a2b3c/           a save in progress (or one that crashed): never picked, removed on resume
    step_00000300.invalid-<reason>/     a checkpoint the job found invalid: never resumed, counted or deleted

A save goes: every rank writes its shards into `step_N.tmp-<nonce>/` (DCP fsyncs each file and the .metadata);
every rank hashes the files it wrote; rank 0 gathers the hashes, writes `manifest.json` (step, world size, stage,
config hash, job name and run id, size + sha256 of every file, HMAC signature), fsyncs it and the directory,
renames the directory to `step_N/` and fsyncs the parent. The rename is the commit: a crash at any point before it
leaves only a `.tmp-` directory.

A checkpoint is valid when its manifest is well-formed and signed by this cluster's key (`signing`), the directory
holds exactly the files it lists with their sizes and sha256, and DCP's `.metadata` is plain checkpoint metadata
(`reader`). The state is DCP's, keyed by fully qualified names with DTensor shards, so it loads on any world size
and any ZeRO stage without a conversion step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, signature_problem
from shardstack.train.checkpoint.reader import DCP_METADATA, ChecksumMismatch, read_dcp_metadata
from shardstack.train.config import JOB_NAME_RE

log = logging.getLogger("shardstack.checkpoint")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "shardstack-checkpoint/2"  # /1 pickled the RNG, sampler and scheduler state and was unsigned
_STEP_RE = re.compile(r"^step_(\d{8})$")
STALE_RE = re.compile(r"^step_\d{8}\.(tmp|deleting)-[0-9a-f]+$")
QUARANTINE_RE = re.compile(r"^step_(\d{8})\.invalid-([a-z0-9-]+?)(?:-[0-9a-f]{8})?$")
SHARD_RE = re.compile(r"^__\d+_\d+\.distcp$")  # DCP's FileSystemWriter names: __<rank>_<n>.distcp
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")
# key → the JSON types it may have; a manifest with any other key, or a key of another type, is malformed.
_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,), "step": (int,), "world_size": (int,), "stage": (int, type(None)), "config_hash": (str,),
    "created": (str,), "host": (str,), "torch_version": (str,), "files": (dict,), "total_bytes": (int,),
    "job_config": (dict, type(None)), "job": (str,), "run_id": (str,), "signature": (dict,),
}
# Absent from manifests written before checkpoints recorded their job (same format: their files load the same way);
# the checkpointer refuses to resume those unless told to adopt them.
_OWNER_FIELDS = ("job", "run_id")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_step_dir(path: str | os.PathLike) -> bool:
    """Named like a committed checkpoint (step_XXXXXXXX); whether it is valid is verify_checkpoint's question."""
    return bool(_STEP_RE.match(Path(path).name))


# --------------------------------------------------------------------------------------------- filesystem helpers


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def write_json_durable(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_tree(path: Path) -> None:
    """Rename first so a half-deleted directory can never look like a committed checkpoint, then delete."""
    doomed = path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ------------------------------------------------------------------------------------------- listing and verifying


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint is invalid: `reason` is a slug (the quarantine suffix, the JSON field), `message` for humans."""

    reason: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class CheckpointInfo:
    """One committed step directory and what verifying it found (`problem` is None when it is valid)."""

    path: Path
    step: int
    manifest: dict[str, Any] | None = None
    problem: Problem | None = None
    checked: str = "manifest"  # how far it was checked: manifest | sizes | sha256
    signed: bool = False  # whether the signature was checked (False: require_signature false / --allow-unsigned)

    @property
    def valid(self) -> bool:
        return self.problem is None


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed step directories under `root`, oldest first (`.tmp-` and `.invalid-` directories are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def list_quarantined(root: str | os.PathLike) -> list[tuple[int, str, Path]]:
    """(step, reason, path) of the quarantined directories under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), m.group(2), e) for e in root.iterdir() if (m := QUARANTINE_RE.match(e.name))]
    return sorted(found)


def quarantine(path: Path, problem: Problem) -> Path:
    """Rename an invalid checkpoint out of the way (`step_N.invalid-<reason>`); nothing in it is deleted."""
    target = path.with_name(f"{path.name}.invalid-{problem.reason}")
    if target.exists():  # the same step quarantined before for the same reason
        target = target.with_name(f"{target.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def _malformed(why: str) -> Problem:
    return Problem("bad-manifest", f"malformed manifest.json: {why}")


def _schema_problem(manifest: dict[str, Any]) -> Problem | None:
    for key, value in manifest.items():
        if key not in _FIELDS:
            return _malformed(f"unexpected key {key!r}")
        if not isinstance(value, _FIELDS[key]) or (isinstance(value, bool) and bool not in _FIELDS[key]):
            return _malformed(f"{key} is {type(value).__name__}")
    missing = sorted(set(_FIELDS) - {"signature", *_OWNER_FIELDS} - set(manifest))
    if missing:
        return _malformed(f"missing {', '.join(missing)}")
    owner = [k for k in _OWNER_FIELDS if k in manifest]
    if len(owner) == 1:
        return _malformed(f"it has {owner[0]} without {({*_OWNER_FIELDS} - {*owner}).pop()}")
    if owner and not JOB_NAME_RE.match(manifest["job"]):
        return _malformed(f"job {manifest['job']!r} is not a job name ([a-z0-9_-], up to 63)")
    if owner and not RUN_ID_RE.match(manifest["run_id"]):
        return _malformed("run_id is not 32 hex digits")
    if manifest["step"] < 0 or manifest["world_size"] < 1:
        return _malformed("step or world_size out of range")
    files = manifest["files"]
    for name, entry in files.items():
        if name != DCP_METADATA and not SHARD_RE.match(name):
            return _malformed(f"file name {name!r} is neither {DCP_METADATA} nor a DCP shard (__<rank>_<n>.distcp)")
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            return _malformed(f"files[{name!r}] is not an object with size and sha256")
        size, digest = entry["size"], entry["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return _malformed(f"files[{name!r}].size is not a byte count")
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            return _malformed(f"files[{name!r}].sha256 is not a hex sha256")
    if DCP_METADATA not in files:
        return _malformed(f"it lists no DCP {DCP_METADATA} file")
    if manifest["total_bytes"] != sum(e["size"] for e in files.values()):
        return _malformed("total_bytes is not the sum of the file sizes")
    return None


def read_manifest(path: str | os.PathLike, *, key: SigningKey | None) -> tuple[dict[str, Any] | None, Problem | None]:
    """The manifest of a step directory, checked (format, signature unless `key` is None, fields, step, the files in
    the directory), or None and why it is unusable. Files' sizes and hashes are `check_files`'s job."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        return None, Problem("no-manifest", "no manifest.json (the save never committed)")
    try:
        manifest = json.loads(mf.read_bytes())
    except (OSError, ValueError) as exc:
        return None, Problem("bad-manifest", f"manifest.json is unreadable ({exc})")
    if not isinstance(manifest, dict):
        return None, _malformed("not a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        return None, Problem("unsupported-format", f"manifest.json is format {manifest.get('format')!r}; this "
                                                   f"shardstack reads {MANIFEST_FORMAT}")
    if key is not None and (sig := signature_problem(manifest, key)) is not None:
        return None, Problem(*sig)
    problem = _schema_problem(manifest)
    if problem is not None:
        return None, problem
    m = _STEP_RE.match(path.name)
    if m and int(m.group(1)) != manifest["step"]:
        return None, Problem("step-mismatch", f"manifest.json says step {manifest['step']} but the directory is "
                                              f"{path.name}")
    try:
        unlisted = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in manifest["files"])
    except OSError as exc:
        return None, Problem("unreadable", f"cannot list {path}: {exc.strerror}")
    if unlisted:
        return None, Problem("unlisted-file", f"unlisted file {unlisted[0]} (not in the manifest)")
    return manifest, None


def check_files(path: Path, files: dict[str, dict[str, Any]], names: list[str], checksums: bool) -> Problem | None:
    """Sizes (and sha256) of `names` against the manifest's `files`; with checksums, `.metadata` is also parsed
    (from the bytes that were hashed)."""
    for name in names:
        expected = files[name]
        f = path / name
        if not f.is_file():
            return Problem("missing-file", f"missing file {name}")
        size = f.stat().st_size
        if size != expected["size"]:
            return Problem("size-mismatch", f"size mismatch for {name}: manifest says {expected['size']} bytes, "
                                            f"found {size} (truncated?)")
        if checksums and name == DCP_METADATA:
            try:
                read_dcp_metadata(path, files)
            except ChecksumMismatch as exc:
                return Problem("checksum-mismatch", str(exc))
            except ShardstackError as exc:
                return Problem("bad-metadata", str(exc))
        elif checksums and _sha256(f) != expected["sha256"]:
            return Problem("checksum-mismatch", f"checksum mismatch for {name} (sha256 differs from the manifest)")
    return None


def verify_checkpoint(path: str | os.PathLike, *, key: SigningKey | None, checksums: bool = True) -> CheckpointInfo:
    """Check one step directory on this process: manifest and signature, every file present, sizes, and (with
    `checksums`) sha256 and the DCP metadata. `key` None skips the signature (an explicit opt-out)."""
    path = Path(path)
    m = _STEP_RE.match(path.name)
    manifest, problem = read_manifest(path, key=key)
    step = int(m.group(1)) if m else manifest["step"] if manifest else -1
    info = CheckpointInfo(path=path, step=step, manifest=manifest, problem=problem, signed=key is not None)
    if manifest is not None:
        info.problem = check_files(path, manifest["files"], sorted(manifest["files"]), checksums)
        info.checked = "sha256" if checksums else "sizes"
    return info


def resolve_checkpoint(path: str | os.PathLike, *, key: SigningKey | None, checksums: bool = True) -> CheckpointInfo:
    """A step directory as given, or the newest valid one under a checkpoint root; raises if there is none."""
    path = Path(path)
    if not path.is_dir():
        raise ShardstackError(f"checkpoint directory {path} does not exist")
    if (path / MANIFEST).is_file() or is_step_dir(path):
        info = verify_checkpoint(path, key=key, checksums=checksums)
        if not info.valid:
            raise ShardstackError(f"checkpoint {path} is not valid: {info.problem}")
        return info
    for _step, step_dir in reversed(list_checkpoints(path)):
        info = verify_checkpoint(step_dir, key=key, checksums=checksums)
        if info.valid:
            return info
        log.warning("skipping checkpoint %s: %s", step_dir.name, info.problem)
    raise ShardstackError(
        f"no valid checkpoint under {path}",
        hint="point at a checkpoint root (with step_XXXXXXXX/ directories) or at one step directory",
    )
