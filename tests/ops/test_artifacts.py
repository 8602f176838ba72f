"""The training-artefact lifecycle (shardstack.node.artifacts): what goes and what always stays, on a real directory
tree, with checkpoints committed by the real checkpoint layout's writer; and the script's promise to the storage node
(standard library only, the layout's names the same as the runtime's)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardstack.node import artifacts
from shardstack.ops.lifecycle import plan_from_report
from shardstack.train.checkpoint import layout

DAY = 86400.0
NOW = time.time()


def _age(path: Path, days: float) -> None:
    """Make a tree look `days` old (every entry's mtime)."""
    t = NOW - days * DAY
    for root, dirs, files in os.walk(path, topdown=False):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (t, t), follow_symlinks=False)
    os.utime(path, (t, t))


def _checkpoint(job: Path, step: int, days: float, *, sound: bool = True) -> Path:
    """A committed step directory as the checkpointer leaves it: shards and a manifest listing them with sizes."""
    d = job / layout.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(os.urandom(1000))
    (d / ".metadata").write_bytes(b"m" * 10)
    files = {p.name: layout.file_entry(p) for p in d.iterdir()}
    if not sound:
        (d / "__0_0.distcp").write_bytes(b"truncated")  # the size no longer matches the manifest
    layout.write_json_durable(d / layout.MANIFEST, {"format": layout.MANIFEST_FORMAT, "step": step, "files": files})
    _age(d, days)
    return d


def _dir(path: Path, days: float, size: int = 100) -> Path:
    path.mkdir(parents=True)
    (path / "data").write_bytes(b"x" * size)
    _age(path, days)
    return path


def _by_name(p: artifacts.Plan) -> dict[str, artifacts.Item]:
    return {Path(i.path).name: i for i in p.items}


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    exports = root / "exports"
    for name, days in [("m1", 40), ("m2", 30), ("m3", 20), ("m4", 10), ("m5", 2), ("m6", 1)]:
        _dir(exports / name, days, 1000)
    os.symlink("m1", exports / "current")  # the served model is the oldest
    _dir(exports / ".current.tmp-x", 30)  # the export helper's own scratch: not an export

    active = root / "checkpoints" / "run-active"  # saved 1 day ago; a save running right now
    for step, days in [(100, 9), (200, 8), (300, 1)]:
        _checkpoint(active, step, days)
    _dir(active / "step_00000400.tmp-3f9a1c2e", 0.01)
    _dir(active / "step_00000050.tmp-0badc0de", 12)            # a save that died long ago
    _dir(active / "step_00000060.deleting-1234abcd", 12)       # a prune cut short
    _dir(active / "step_00000070.invalid-checksum-mismatch", 30)  # quarantined
    _dir(active / "step_00000080.invalid-no-manifest", 3)      # quarantined recently: kept for inspection

    idle = root / "checkpoints" / "run-idle"  # nothing written for 20 days; its newest is damaged
    for step, days in [(10, 25), (20, 22)]:
        _checkpoint(idle, step, days)
    _checkpoint(idle, 30, 20, sound=False)
    os.utime(idle, (NOW - 20 * DAY, NOW - 20 * DAY))  # the job directory itself changes with every save

    unknown = root / "checkpoints" / "run-foreign"  # committed, but none sound (another format, say)
    _checkpoint(unknown, 5, 50, sound=False)
    _checkpoint(unknown, 6, 50, sound=False)
    os.utime(unknown, (NOW - 50 * DAY, NOW - 50 * DAY))
    _dir(root / "data" / "corpus", 100)
    return root


def test_the_plan_keeps_what_serves_resumes_or_is_recent(shared: Path) -> None:
    p = artifacts.plan(shared, keep_exports=2, older_than_days=7, now=NOW)
    items = _by_name(p)
    gone = {Path(i.path).relative_to(shared).as_posix() for i in p.deletions}
    assert gone == {
        "exports/m2", "exports/m3", "exports/m4",            # beyond the newest 2, older than 7 days
        "checkpoints/run-active/step_00000050.tmp-0badc0de",
        "checkpoints/run-active/step_00000060.deleting-1234abcd",
        "checkpoints/run-active/step_00000070.invalid-checksum-mismatch",
        "checkpoints/run-idle/step_00000010",               # older than the idle job's resume point
    }
    assert items["m1"].reason == "exports/current points to it (being served)"
    assert items["m5"].action == items["m6"].action == "keep"
    assert items["step_00000400.tmp-3f9a1c2e"].action == "keep"  # a save in progress
    assert items["step_00000080.invalid-no-manifest"].reason.startswith("younger than 7 days")
    # The idle job's newest is damaged: its resume would fall back to step 20, which therefore stays.
    assert items["step_00000020"].reason == "the job's newest sound checkpoint (its resume point)"
    assert items["step_00000030"].action == "keep"
    # The running job keeps every committed checkpoint: its own keep rule decides.
    assert all(items[f"step_00000{s}"].action == "keep" for s in (100, 200, 300))
    assert items["step_00000100"].reason.startswith("the job changed")
    # No sound checkpoint at all: nothing committed is deleted.
    assert items["step_00000005"].reason == "the job has no sound checkpoint: none is deleted"
    assert not any("data" in Path(i.path).parts[len(shared.parts):][:1] for i in p.items)
    assert items["m2"].bytes == 1000 and items["m2"].age_days == pytest.approx(30, abs=0.01)


def test_nothing_younger_than_the_limit_ever_goes(shared: Path) -> None:
    p = artifacts.plan(shared, keep_exports=0, older_than_days=365, now=NOW)
    assert p.deletions == []


def test_apply_deletes_exactly_the_plan(shared: Path) -> None:
    before = {p.relative_to(shared) for p in shared.rglob("*")}
    p = artifacts.apply(artifacts.plan(shared, keep_exports=2, older_than_days=7, now=NOW, dry_run=False))
    assert not p.errors and sorted(p.deleted) == sorted(i.path for i in p.deletions)
    after = {p.relative_to(shared) for p in shared.rglob("*")}
    removed = {x for x in before - after if not any(parent in before - after for parent in x.parents)}
    assert {x.as_posix() for x in removed} == {Path(i.path).relative_to(shared).as_posix() for i in p.deletions}
    assert (shared / "exports" / "current").resolve() == (shared / "exports" / "m1").resolve()


def test_apply_refuses_paths_outside_exports_and_checkpoints(shared: Path, tmp_path: Path) -> None:
    outside = _dir(tmp_path / "elsewhere", 100)
    p = artifacts.plan(shared, keep_exports=2, older_than_days=7, now=NOW, dry_run=False)
    p.items = [artifacts.Item(str(outside), "export", 1, 100, "delete", "forged"),
               artifacts.Item(str(shared / "data"), "export", 1, 100, "delete", "forged")]
    artifacts.apply(p)
    assert outside.exists() and (shared / "data").exists() and len(p.errors) == 2 and not p.deleted


def test_the_script_on_the_node_dry_run_then_for_real(shared: Path) -> None:
    script = Path(artifacts.__file__)
    argv = [sys.executable, str(script), "--shared-dir", str(shared), "--keep-exports", "2", "--older-than", "7"]
    dry = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True, check=True)
    report = json.loads(dry.stdout)
    assert report["dry_run"] and report["deleted"] == [] and report["delete_bytes"] > 3000
    assert (shared / "exports" / "m2").exists()
    plan = plan_from_report(report)  # what the controller reads back from set_stats
    assert len(plan.deletions) == 7
    real = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    assert len(real["deleted"]) == 7 and not (shared / "exports" / "m2").exists()
    bad = subprocess.run([sys.executable, str(script), "--shared-dir", str(shared / "nope")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "is not a directory" in bad.stdout


def test_the_script_needs_only_the_standard_library() -> None:
    tree = ast.parse(Path(artifacts.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)


def test_the_layout_names_are_the_runtimes() -> None:
    assert artifacts.MANIFEST == layout.MANIFEST and artifacts.MANIFEST_FORMAT == layout.MANIFEST_FORMAT
    for ours, theirs in [(artifacts.STEP_RE, layout._STEP_RE), (artifacts.STALE_RE, layout.STALE_RE),
                         (artifacts.QUARANTINE_RE, layout.QUARANTINE_RE)]:
        assert ours.pattern == theirs.pattern
