"""Single-process behaviour of `Checkpointer`: atomic commit, signed manifest, keep-N, verified resume, quarantine
and its fallbacks."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, canonical
from shardstack.train.checkpoint.layout import (
    MANIFEST,
    list_checkpoints,
    list_quarantined,
    resolve_checkpoint,
    verify_checkpoint,
)

from .conftest import AppState, make_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train_and_save(root: Path, key_file: Path | None, app: AppState, steps: int, **overrides) -> None:
    ckpt = make_checkpointer(root, key_file, **overrides)
    start = ckpt.resume(app)
    for _ in range(start, steps):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    ckpt.finish(app.step, app)


def _assert_same_state(a: AppState, b: AppState) -> None:
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(sa[k][field], sb[k][field], rtol=0, atol=0)
    assert a.step == b.step


def _steps(root: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(root)]


def test_save_commits_step_directories_with_a_signed_manifest_and_keeps_the_last_n(
    tmp_path: Path, key_file: Path, key: SigningKey, app: AppState
) -> None:
    _train_and_save(tmp_path, key_file, app, 8, interval=2, keep=2)
    assert _steps(tmp_path) == [6, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008"]  # no tmp, no deleting
    step_dir = tmp_path / "step_00000008"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 1 and manifest["stage"] == 3
    assert manifest["config_hash"] == "cafe" and manifest["job_config"]["model"]["d_model"] == 32
    on_disk = {p.name for p in step_dir.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk and "__0_0.distcp" in on_disk
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["total_bytes"] == sum(e["size"] for e in manifest["files"].values())
    # HMAC-SHA256 over the sorted-key JSON without the signature, by the key in the key file.
    import hmac

    expected = hmac.new(key.secret, canonical(manifest), hashlib.sha256).hexdigest()
    assert manifest["signature"] == {"algorithm": "hmac-sha256", "key_id": key.key_id, "hmac": expected}
    assert verify_checkpoint(step_dir, key=key).valid


def test_resume_restores_model_optimizer_and_step_and_continues_identically(tmp_path: Path, key_file: Path) -> None:
    reference = AppState()
    ref_losses = reference.train(6)
    first = AppState()
    _train_and_save(tmp_path, key_file, first, 4, interval=4)
    resumed = AppState(seed=123)  # different init: everything must come from the checkpoint
    assert make_checkpointer(tmp_path, key_file).resume(resumed) == 4
    _assert_same_state(first, resumed)
    assert resumed.train(2) == pytest.approx(ref_losses[4:], rel=1e-6)


def test_finish_saves_the_last_step_once(tmp_path: Path, key_file: Path, app: AppState) -> None:
    _train_and_save(tmp_path, key_file, app, 5, interval=2, keep=0)
    assert _steps(tmp_path) == [2, 4, 5]


@pytest.mark.parametrize("async_save", [False, True])
def test_on_commit_reports_each_step_once_it_is_committed(tmp_path: Path, key_file: Path, app: AppState,
                                                          async_save: bool) -> None:
    """What the trainer exports as shardstack_train_last_checkpoint_step: a step only once its manifest is there."""
    committed: list[tuple[int, bool]] = []
    ckpt = make_checkpointer(tmp_path, key_file, interval=2, keep=0, async_save=async_save)
    ckpt.on_commit = lambda step: committed.append((step, (tmp_path / f"step_{step:08d}" / MANIFEST).exists()))
    for _ in range(5):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    ckpt.finish(app.step, app)
    assert committed == [(2, True), (4, True), (5, True)]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason", "slug"),
    [
        (lambda d: _truncate(d / "__0_0.distcp"), "size mismatch for __0_0.distcp", "size-mismatch"),
        (lambda d: _flip_byte(d / "__0_0.distcp"), "checksum mismatch for __0_0.distcp", "checksum-mismatch"),
        (lambda d: _flip_byte(d / ".metadata"), "checksum mismatch for .metadata", "checksum-mismatch"),
        (lambda d: (d / "__0_0.distcp").unlink(), "missing file __0_0.distcp", "missing-file"),
        (lambda d: (d / MANIFEST).unlink(), "no manifest.json", "no-manifest"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "manifest.json is unreadable", "bad-manifest"),
    ],
    ids=["truncated", "altered", "altered-metadata", "missing-shard", "no-manifest", "bad-manifest"],
)
def test_resume_auto_skips_and_quarantines_a_damaged_newest_checkpoint_and_says_why(
    tmp_path: Path, key_file: Path, key: SigningKey, caplog: pytest.LogCaptureFixture, damage, reason: str, slug: str
) -> None:
    saved = AppState()
    _train_and_save(tmp_path, key_file, saved, 4, interval=2)
    expected = AppState(seed=7)
    assert make_checkpointer(tmp_path, key_file, resume=str(tmp_path / "step_00000002")).resume(expected) == 2
    damage(tmp_path / "step_00000004")
    assert not verify_checkpoint(tmp_path / "step_00000004", key=key).valid
    resumed = AppState(seed=9)
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        assert make_checkpointer(tmp_path, key_file).resume(resumed) == 2
    _assert_same_state(expected, resumed)
    skip = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skip) == 1 and "step_00000004" in skip[0] and reason in skip[0], skip
    assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(4, slug)]
    assert f"quarantined step_00000004 as step_00000004.invalid-{slug}" in caplog.text
    assert _steps(tmp_path) == [2]


def test_training_on_after_a_fallback_saves_the_step_again_beside_the_quarantined_one(
    tmp_path: Path, key_file: Path, key: SigningKey, app: AppState
) -> None:
    _train_and_save(tmp_path, key_file, app, 4, interval=2)
    _truncate(tmp_path / "step_00000004" / "__0_0.distcp")
    again = AppState(seed=1)
    _train_and_save(tmp_path, key_file, again, 6, interval=2)
    assert _steps(tmp_path) == [2, 4, 6]
    assert all(verify_checkpoint(p, key=key).valid for _, p in list_checkpoints(tmp_path))
    assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(4, "size-mismatch")]


def test_pruning_never_counts_damaged_checkpoints_and_the_next_restart_resumes_from_the_valid_one(
    tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    """The issue's scenario: 2, 4, 6 saved; 4 and 6 damaged; keep 2; the job resumes from 2 and saves 3. On main it
    pruned 2 and 3 and kept only the damaged ones, so the next restart began at step 0."""
    _train_and_save(tmp_path, key_file, AppState(), 6, interval=2, keep=0)
    for step in (4, 6):
        _truncate(tmp_path / f"step_{step:08d}" / "__0_0.distcp")
    app = AppState(seed=1)
    ckpt = make_checkpointer(tmp_path, key_file, interval=1, keep=2)
    assert ckpt.resume(app) == 2
    app.train(1)
    assert ckpt.maybe_save(app.step, app)
    assert _steps(tmp_path) == [2, 3]
    assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(4, "size-mismatch"), (6, "size-mismatch")]
    restarted = AppState(seed=2)
    assert make_checkpointer(tmp_path, key_file, keep=2).resume(restarted) == 3
    _assert_same_state(app, restarted)


def test_pruning_quarantines_a_checkpoint_damaged_after_resume_and_keeps_the_valid_ones(
    tmp_path: Path, key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = AppState()
    ckpt = make_checkpointer(tmp_path, key_file, interval=1, keep=2)
    ckpt.resume(app)
    for _ in range(3):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    assert _steps(tmp_path) == [2, 3]
    _truncate(tmp_path / "step_00000003" / "__0_0.distcp")  # damaged while the job runs
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    # 3 is not counted: 2 and the new 4 are the two kept; 3 is renamed, not deleted.
    assert _steps(tmp_path) == [2, 4]
    assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(3, "size-mismatch")]
    assert "checkpoint " + str(tmp_path / "step_00000003") + " is not valid: size mismatch" in caplog.text


def test_uncommitted_directories_are_never_resumed_and_are_cleaned_up(
    tmp_path: Path, key_file: Path, app: AppState, caplog: pytest.LogCaptureFixture
) -> None:
    _train_and_save(tmp_path, key_file, app, 2, interval=2)
    # A save that died before its rename: even a complete-looking one (with a manifest) must not be picked.
    shutil.copytree(tmp_path / "step_00000002", tmp_path / "step_00000004.tmp-0badf00d")
    (tmp_path / "step_00000006.tmp-12345678").mkdir()
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        assert make_checkpointer(tmp_path, key_file).resume(AppState(seed=3)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    assert sum("never finished" in r.getMessage() for r in caplog.records) == 2


def test_no_checkpoint_or_resume_never_starts_from_zero(tmp_path: Path, key_file: Path, app: AppState) -> None:
    assert make_checkpointer(tmp_path / "fresh", key_file).resume(app) == 0
    _train_and_save(tmp_path, key_file, app, 2, interval=2)
    assert make_checkpointer(tmp_path, key_file, resume="never").resume(AppState()) == 0


def test_an_explicit_invalid_resume_path_is_an_error_naming_the_problem(
    tmp_path: Path, key_file: Path, key: SigningKey, app: AppState
) -> None:
    _train_and_save(tmp_path, key_file, app, 2, interval=2)
    _flip_byte(tmp_path / "step_00000002" / ".metadata")
    with pytest.raises(ShardstackError, match=r"step_00000002.*checksum mismatch for \.metadata"):
        make_checkpointer(tmp_path, key_file, resume=str(tmp_path / "step_00000002")).resume(AppState())
    with pytest.raises(ShardstackError, match="no valid checkpoint"):
        resolve_checkpoint(tmp_path, key=key)


def test_async_save_commits_in_the_background_and_finish_waits(
    tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    reference = AppState()
    ref_losses = reference.train(6)
    app = AppState()
    ckpt = make_checkpointer(tmp_path, key_file, interval=2, async_save=True, keep=0)
    losses = []
    for _ in range(4):
        losses += app.train(1)  # training on while a save is in flight must not change what was saved
        ckpt.maybe_save(app.step, app)
    ckpt.finish(app.step, app)
    assert losses == pytest.approx(ref_losses[:4], rel=1e-6)
    assert _steps(tmp_path) == [2, 4]
    assert all(verify_checkpoint(p, key=key).valid for _, p in list_checkpoints(tmp_path))
    resumed = AppState(seed=5)
    assert make_checkpointer(tmp_path, key_file, resume=str(tmp_path / "step_00000002")).resume(resumed) == 2
    assert resumed.train(4) == pytest.approx(ref_losses[2:], rel=1e-6)


def test_disabled_without_a_directory(tmp_path: Path, app: AppState) -> None:
    off = make_checkpointer(tmp_path, tmp_path / "no-key-needed", dir=None)
    assert off.key is None and off.resume(app) == 0 and off.maybe_save(2, app) is False
    off.finish(2, app)
    assert list(tmp_path.iterdir()) == []
