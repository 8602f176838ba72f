"""Sharded training checkpoints: torch.distributed.checkpoint (DCP) per step directory, committed atomically.

Layout under `checkpoint.dir`::

    step_00000100/            a committed checkpoint: DCP shards (__<rank>_<n>.distcp), .metadata, manifest.json
    step_00000200.tmp-1a2b3c/ a save in progress (or one that crashed): never picked, removed on the next resume

A save goes: every rank writes its shards into `step_N.tmp-<nonce>/` (DCP fsyncs each file and the .metadata);
every rank hashes the files it wrote; rank 0 gathers the hashes, writes `manifest.json` (step, world size, stage,
config hash, size + sha256 of every file), fsyncs it and the directory, renames the directory to `step_N/` and
fsyncs the parent. The rename is the commit: a crash at any point before it leaves only a `.tmp-` directory.

Resume (`resume: auto`) walks the committed directories newest first and takes the first whose manifest verifies
(every file present, sizes and sha256 equal; the ranks hash disjoint subsets of the files in parallel); each one
skipped is logged with the reason. The state is DCP's, keyed by fully qualified names with DTensor/ShardedTensor
shards, so it loads on any world size and any ZeRO stage without a conversion step.
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

log = logging.getLogger("shardstack.checkpoint")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "shardstack-checkpoint/1"
DCP_METADATA = ".metadata"
_STEP_RE = re.compile(r"^step_(\d{8})$")
STALE_RE = re.compile(r"^step_\d{8}\.(tmp|deleting)-[0-9a-f]+$")


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


@dataclass
class CheckpointInfo:
    """One committed step directory and what verifying it found (`problem` is None when it is valid)."""

    path: Path
    step: int
    manifest: dict[str, Any] | None = None
    problem: str | None = None
    checked: str = "manifest"  # how far it was checked: manifest | sizes | sha256

    @property
    def valid(self) -> bool:
        return self.problem is None


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed step directories under `root`, oldest first (in-progress `.tmp-` directories are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def read_manifest(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest of a step directory, or None and why it is unusable."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        return None, "no manifest.json (the save never committed)"
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as exc:
        return None, f"manifest.json is unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"manifest.json is not a {MANIFEST_FORMAT} manifest"
    if not isinstance(manifest.get("files"), dict) or DCP_METADATA not in manifest["files"]:
        return None, "manifest.json lists no DCP .metadata file"
    m = _STEP_RE.match(path.name)
    if m and int(m.group(1)) != manifest.get("step"):
        return None, f"manifest.json says step {manifest.get('step')} but the directory is {path.name}"
    return manifest, None


def check_files(path: Path, files: dict[str, dict[str, Any]], names: list[str], checksums: bool) -> str | None:
    for name in names:
        expected = files[name]
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        size = f.stat().st_size
        if size != expected["size"]:
            return f"size mismatch for {name}: manifest says {expected['size']} bytes, found {size} (truncated?)"
        if checksums and _sha256(f) != expected["sha256"]:
            return f"checksum mismatch for {name} (sha256 differs from the manifest)"
    return None


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> CheckpointInfo:
    """Check one step directory on this process: manifest, every file present, sizes, and (optionally) sha256."""
    path = Path(path)
    m = _STEP_RE.match(path.name)
    manifest, problem = read_manifest(path)
    step = int(m.group(1)) if m else int(manifest.get("step", -1)) if manifest else -1
    info = CheckpointInfo(path=path, step=step, manifest=manifest, problem=problem)
    if manifest is not None:
        info.problem = check_files(path, manifest["files"], sorted(manifest["files"]), checksums)
        info.checked = "sha256" if checksums else "sizes"
    return info


def resolve_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> CheckpointInfo:
    """A step directory as given, or the newest valid one under a checkpoint root; raises if there is none."""
    path = Path(path)
    if not path.is_dir():
        raise ShardstackError(f"checkpoint directory {path} does not exist")
    if (path / MANIFEST).is_file() or is_step_dir(path):
        info = verify_checkpoint(path, checksums=checksums)
        if not info.valid:
            raise ShardstackError(f"checkpoint {path} is not valid: {info.problem}")
        return info
    for _step, step_dir in reversed(list_checkpoints(path)):
        info = verify_checkpoint(step_dir, checksums=checksums)
        if info.valid:
            return info
        log.warning("skipping checkpoint %s: %s", step_dir.name, info.problem)
    raise ShardstackError(
        f"no valid checkpoint under {path}",
        hint="point at a checkpoint root (with step_XXXXXXXX/ directories) or at one step directory",
    )
