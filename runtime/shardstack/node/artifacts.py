#!/usr/bin/python3
"""The lifecycle of training artefacts on shared storage: what `shardstack artifacts prune` deletes, and why.

It runs where the storage is (the first storage_server), shipped there by playbooks/artifacts_prune.yml, and the
shared_storage role's prune timer (tasks/prune.yml) runs the same file; so it uses the standard library only, and
the checkpoint layout's names are repeated here (tests/ops/test_artifacts.py holds them equal to
shardstack.train.checkpoint.layout's).

Under <shared>/ (shardstack_shared_dir):

- exports/<name>/: the newest `keep_exports` exports and the one `exports/current` points to are kept; older ones
  go once they are older than `older_than_days`.
- checkpoints/<job>/step_N.tmp-*, step_N.deleting-* (a save that died, a prune that was cut short) and
  step_N.invalid-* (quarantined by a resume): they go once older than `older_than_days`. A save in progress writes
  into its .tmp- directory, so it is never that old.
- checkpoints/<job>/step_N (committed): the newest sound one of every job (manifest.json present and readable, the
  job's format, its step, every listed file there with its size: what a resume checks short of the signature and
  hashes) is always kept, and so is everything newer. Older ones go only from a job that is idle: nothing under its
  directory changed for `older_than_days`. A running job's own keep rule manages its committed checkpoints.
- data/ and anything not named above are never touched.

Nothing younger than `older_than_days` is ever deleted, symlinks are never followed, and every path is checked to lie
inside the shared directory before it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# shardstack.train.checkpoint.layout's names (kept equal by a test; this file may not import shardstack).
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "shardstack-checkpoint/2"
STEP_RE = re.compile(r"^step_(\d{8})$")
STALE_RE = re.compile(r"^step_\d{8}\.(tmp|deleting)-[0-9a-f]+$")
QUARANTINE_RE = re.compile(r"^step_(\d{8})\.invalid-([a-z0-9-]+?)(?:-[0-9a-f]{8})?$")
CURRENT = "current"  # exports/current -> the served export (shardstack.ops.storage.export_current)
DAY = 86400.0


@dataclass
class Item:
    path: str
    kind: str        # export | checkpoint | stale | quarantined
    bytes: int
    age_days: float
    action: str      # delete | keep
    reason: str


@dataclass
class Plan:
    shared_dir: str
    keep_exports: int
    older_than_days: float
    dry_run: bool
    items: list[Item] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def deletions(self) -> list[Item]:
        return [i for i in self.items if i.action == "delete"]

    def to_dict(self) -> dict:
        return {**asdict(self), "delete_bytes": sum(i.bytes for i in self.deletions)}


def tree_stats(path: Path) -> tuple[int, float]:
    """Bytes and newest mtime under `path` (itself included), without following symlinks."""
    st = path.lstat()
    size, newest = (st.st_size if not path.is_dir() else 0), st.st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    s = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                newest = max(newest, s.st_mtime)
                if name in files:
                    size += s.st_size
    return size, newest


def sound(step_dir: Path) -> bool:
    """A committed checkpoint a resume would get past without hashing: manifest, format, step, files and sizes."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        m = STEP_RE.match(step_dir.name)
        if not (isinstance(manifest, dict) and m and manifest.get("format") == MANIFEST_FORMAT
                and manifest.get("step") == int(m.group(1)) and isinstance(manifest.get("files"), dict)):
            return False
        return all(isinstance(meta, dict) and "/" not in name and name not in ("", ".", "..")
                   and (step_dir / name).is_file() and not (step_dir / name).is_symlink()
                   and (step_dir / name).stat().st_size == meta.get("size")
                   for name, meta in manifest["files"].items())
    except (OSError, ValueError, TypeError):
        return False


def _item(path: Path, kind: str, now: float, action: str, reason: str) -> Item:
    size, newest = tree_stats(path)
    return Item(str(path), kind, size, round((now - newest) / DAY, 2), action, reason)


def plan_exports(exports: Path, keep: int, older_than: float, now: float) -> list[Item]:
    if not exports.is_dir():
        return []
    current = exports / CURRENT
    served = os.readlink(current) if current.is_symlink() else None
    served_name = Path(served).name if served else None
    found = [p for p in exports.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    found.sort(key=lambda p: tree_stats(p)[1], reverse=True)
    items = []
    for rank, path in enumerate(found):
        item = _item(path, "export", now, "keep", "")
        if path.name == served_name:
            item.reason = "exports/current points to it (being served)"
        elif rank < keep:
            item.reason = f"one of the newest {keep}"
        elif item.age_days < older_than:
            item.reason = f"younger than {older_than:g} days"
        else:
            item.action, item.reason = "delete", f"beyond the newest {keep}, {item.age_days:g} days old"
        items.append(item)
    return items


def plan_job(job: Path, older_than: float, now: float) -> list[Item]:
    items: list[Item] = []
    steps: list[tuple[int, Path]] = []
    for path in sorted(job.iterdir()):
        if path.is_symlink() or not path.is_dir():
            continue
        if m := STEP_RE.match(path.name):
            steps.append((int(m.group(1)), path))
            continue
        kind = "stale" if STALE_RE.match(path.name) else "quarantined" if QUARANTINE_RE.match(path.name) else None
        if kind is None:
            continue  # not ours to judge
        item = _item(path, kind, now, "keep", "")
        if item.age_days < older_than:
            writing = " (a save may be writing it)" if kind == "stale" else ""
            item.reason = f"younger than {older_than:g} days{writing}"
        else:
            what = "an unfinished save or cut-short prune" if kind == "stale" else "quarantined by a resume"
            item.action, item.reason = "delete", f"{what}, {item.age_days:g} days old"
        items.append(item)
    steps.sort(reverse=True)
    idle_days = (now - tree_stats(job)[1]) / DAY
    newest_sound = next((step for step, path in steps if sound(path)), None)
    for step, path in steps:
        item = _item(path, "checkpoint", now, "keep", "")
        if newest_sound is None:
            item.reason = "the job has no sound checkpoint: none is deleted"
        elif step == newest_sound:
            item.reason = "the job's newest sound checkpoint (its resume point)"
        elif step > newest_sound:
            item.reason = "newer than the job's newest sound checkpoint (its resume decides)"
        elif idle_days < older_than:
            item.reason = f"the job changed {idle_days:.1f} days ago: its own keep rule applies"
        elif item.age_days < older_than:
            item.reason = f"younger than {older_than:g} days"
        else:
            item.action, item.reason = "delete", f"older than the resume point of a job idle {idle_days:.1f} days"
        items.append(item)
    return items


def plan(shared: Path, keep_exports: int, older_than_days: float, now: float | None = None,
         dry_run: bool = True) -> Plan:
    now = time.time() if now is None else now
    out = Plan(str(shared), keep_exports, older_than_days, dry_run)
    out.items += plan_exports(shared / "exports", keep_exports, older_than_days, now)
    checkpoints = shared / "checkpoints"
    if checkpoints.is_dir():
        for job in sorted(checkpoints.iterdir()):
            if job.is_dir() and not job.is_symlink():
                out.items += plan_job(job, older_than_days, now)
    return out


def apply(p: Plan) -> Plan:
    """Delete what the plan says, each path checked to lie under exports/ or checkpoints/ of the shared directory."""
    root = Path(p.shared_dir).resolve()
    allowed = (root / "exports", root / "checkpoints")
    for item in p.deletions:
        path = Path(item.path)
        try:
            real = path.resolve()
            if path.is_symlink() or not any(real.parent == a or a in real.parents for a in allowed):
                raise OSError("outside the shared directory's exports/ and checkpoints/, or a symlink")
            shutil.rmtree(real)
            p.deleted.append(item.path)
        except OSError as exc:
            p.errors.append(f"{item.path}: {exc}")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prune old training artefacts on shared storage (see the module doc).")
    ap.add_argument("--shared-dir", type=Path, required=True)
    ap.add_argument("--keep-exports", type=int, default=3)
    ap.add_argument("--older-than", type=float, default=7.0, help="days; nothing younger is deleted")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.keep_exports < 0 or args.older_than < 0:
        print(json.dumps({"error": "--keep-exports and --older-than must not be negative"}))
        return 2
    if not args.shared_dir.is_dir():
        print(json.dumps({"error": f"{args.shared_dir} is not a directory"}))
        return 2
    p = plan(args.shared_dir, args.keep_exports, args.older_than, dry_run=args.dry_run)
    if not args.dry_run:
        apply(p)
    print(json.dumps(p.to_dict()))
    return 1 if p.errors else 0


if __name__ == "__main__":
    sys.exit(main())
