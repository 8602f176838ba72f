"""Checkpoints belong to a job: the signed manifest names the job and its run id, a resume refuses another job's
checkpoint (however new) and, unless allowed, one written under another config or before manifests named their
job; and the files a resume loads are hashed as they are read, so a file swapped after verification cannot change
what is loaded. Real checkpoints from the real Checkpointer, and real `shardstack train run`s."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from shardstack.cli import main as cli
from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey, sign
from shardstack.train.checkpoint.layout import MANIFEST, list_checkpoints, list_quarantined, verify_checkpoint
from shardstack.train.checkpoint.reader import CheckpointReader, WeightsOnlyLoadPlanner, dcp_failure
from shardstack.train.data import prepare
from torch.distributed.checkpoint.api import CheckpointException

from .conftest import AppState, make_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(root: Path, key_file: Path, steps: int, **overrides: Any) -> AppState:
    app = AppState()
    ckpt = make_checkpointer(root, key_file, interval=2, keep=0, **overrides)
    ckpt.resume(app)
    for _ in range(steps - app.step):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    ckpt.finish(app.step, app)
    return app


def _manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / MANIFEST).read_text())


def _params(app: AppState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in app.model.state_dict().items()}


def test_the_manifest_names_the_job_and_a_run_id_carried_across_resumes(tmp_path: Path, key_file: Path,
                                                                        key: SigningKey) -> None:
    root = tmp_path / "ckpt"
    _save(root, key_file, 4, job="mine")
    first, second = _manifest(root / "step_00000002"), _manifest(root / "step_00000004")
    assert first["job"] == second["job"] == "mine"
    assert len(first["run_id"]) == 32 and first["run_id"] == second["run_id"]
    assert verify_checkpoint(root / "step_00000004", key=key).valid  # the signature covers both fields
    _save(root, key_file, 6, job="mine")  # a restart of the same job: resumes 4, keeps the run id
    assert _manifest(root / "step_00000006")["run_id"] == first["run_id"]
    _save(tmp_path / "fresh", key_file, 2, job="mine")  # the same job started afresh elsewhere: a new run
    assert _manifest(tmp_path / "fresh" / "step_00000002")["run_id"] != first["run_id"]


def test_another_jobs_signed_checkpoint_with_a_higher_step_is_refused(tmp_path: Path, key_file: Path) -> None:
    """The issue: job B's valid, signed step 6 in job A's directory used to be resumed by A."""
    root = tmp_path / "ckpt"
    _save(root, key_file, 2, job="mine")
    _save(tmp_path / "theirs", key_file, 6, job="other")
    shutil.move(tmp_path / "theirs" / "step_00000006", root / "step_00000006")
    theirs = root / "step_00000006"
    line = f"checkpoint {theirs} belongs to job 'other', not to this job 'mine': refusing to resume it"
    with pytest.raises(ShardstackError) as err:
        make_checkpointer(root, key_file, job="mine").resume(AppState(seed=1))
    assert str(err.value).splitlines()[0] == line
    assert "give each job its own checkpoint.dir" in str(err.value)
    # Named explicitly it is refused the same way; nothing is quarantined or deleted, it is valid, just not ours.
    with pytest.raises(ShardstackError, match="belongs to job 'other', not to this job 'mine'"):
        make_checkpointer(root, key_file, job="mine", resume=str(theirs)).resume(AppState(seed=1))
    assert [s for s, _ in list_checkpoints(root)] == [2, 6] and list_quarantined(root) == []
    # Their own job resumes it.
    assert make_checkpointer(root, key_file, job="other").resume(AppState(seed=1)) == 6


def test_a_config_change_is_refused_without_the_flag_and_resumed_with_it(
    tmp_path: Path, key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, key_file, 4, job="mine", config_hash="cafe")
    step = root / "step_00000004"
    with pytest.raises(ShardstackError) as err:
        make_checkpointer(root, key_file, job="mine", config_hash="beef").resume(AppState(seed=1))
    assert str(err.value).splitlines()[0] == (
        f"checkpoint {step} of job 'mine' was written with config hash cafe, this job's config hashes to beef: "
        "refusing to resume it")
    assert "--allow-config-change" in str(err.value)
    resumed = AppState(seed=1)
    ckpt = make_checkpointer(root, key_file, job="mine", config_hash="beef", allow_config_change=True, keep=0)
    with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
        assert ckpt.resume(resumed) == 4
    assert "written with config hash cafe, this job has beef; resuming anyway" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed).values(), _params(saved).values(), strict=True))
    resumed.train(2)
    ckpt.maybe_save(resumed.step, resumed)  # the continued run records the new hash and keeps its run id
    assert _manifest(root / "step_00000006")["config_hash"] == "beef"
    assert _manifest(root / "step_00000006")["run_id"] == _manifest(step)["run_id"]
    assert make_checkpointer(root, key_file, job="mine", config_hash="beef").resume(AppState(seed=1)) == 6


def test_a_same_job_resume_continues_the_run(tmp_path: Path, key_file: Path) -> None:
    root = tmp_path / "ckpt"
    reference = AppState()
    ref_losses = reference.train(6)
    saved = _save(root, key_file, 4, job="mine")
    resumed = AppState(seed=3)
    assert make_checkpointer(root, key_file, job="mine").resume(resumed) == 4 and resumed.step == saved.step
    assert resumed.train(2) == pytest.approx(ref_losses[4:], rel=1e-6)


def test_a_checkpoint_that_names_no_job_is_refused_unless_adopted(
    tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    """Written before manifests named their job: signed by this cluster, but it could be any job's."""
    root = tmp_path / "ckpt"
    _save(root, key_file, 4, job="mine")
    for step_dir in (root / "step_00000002", root / "step_00000004"):  # as the previous release wrote them
        old = {k: v for k, v in _manifest(step_dir).items() if k not in ("job", "run_id", "signature")}
        (step_dir / MANIFEST).write_text(json.dumps(sign(old, key)))
    assert verify_checkpoint(root / "step_00000004", key=key).valid  # still a valid checkpoint: never quarantined
    with pytest.raises(ShardstackError) as err:
        make_checkpointer(root, key_file, job="mine").resume(AppState(seed=1))
    assert str(err.value).splitlines()[0] == (
        f"checkpoint {root / 'step_00000004'} names no job (it was written before checkpoints recorded their job), "
        "so it cannot be told apart from another job's; this job is 'mine': refusing to resume it")
    assert "resume once with --allow-config-change" in str(err.value) and list_quarantined(root) == []
    app = AppState(seed=1)
    ckpt = make_checkpointer(root, key_file, job="mine", allow_config_change=True, keep=0)
    assert ckpt.resume(app) == 4
    app.train(2)
    ckpt.maybe_save(app.step, app)
    adopted = _manifest(root / "step_00000006")
    assert adopted["job"] == "mine" and len(adopted["run_id"]) == 32
    assert make_checkpointer(root, key_file, job="mine").resume(AppState(seed=1)) == 6  # no flag needed any more


def test_a_job_starting_over_never_prunes_or_overwrites_another_jobs_checkpoints(tmp_path: Path,
                                                                                 key_file: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, key_file, 4, job="other")
    app = AppState(seed=1)
    ckpt = make_checkpointer(root, key_file, job="mine", resume="never", keep=1)
    app.train(6)
    assert ckpt.save(6, app)  # keep 1: its own 6 stays; the other job's 2 and 4 are not its to count or delete
    assert [s for s, _ in list_checkpoints(root)] == [2, 4, 6]
    with pytest.raises(ShardstackError, match=rf"cannot commit checkpoint step 4: {root / 'step_00000004'} belongs "
                                              r"to job 'other', not to this job 'mine'"):
        ckpt.save(4, app)
    assert _manifest(root / "step_00000004")["job"] == "other"


@pytest.mark.parametrize("edit", [
    lambda m: {**m, "job": "Not A Job"},
    lambda m: {k: v for k, v in m.items() if k != "run_id"},
    lambda m: {**m, "run_id": "xyz"},
], ids=["bad-job", "job-without-run-id", "bad-run-id"])
def test_a_malformed_owner_is_a_malformed_manifest(tmp_path: Path, key_file: Path, key: SigningKey, edit) -> None:
    root = tmp_path / "ckpt"
    _save(root, key_file, 2, job="mine")
    step_dir = root / "step_00000002"
    manifest = edit({k: v for k, v in _manifest(step_dir).items() if k != "signature"})
    (step_dir / MANIFEST).write_text(json.dumps(sign(manifest, key)))
    problem = verify_checkpoint(step_dir, key=key).problem
    assert problem is not None and problem.reason == "bad-manifest", problem


def _flip_inside_the_largest_item(step_dir: Path, name: str) -> None:
    """One byte changed in the middle of the biggest tensor stored in `name`: same size, still loadable."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    info = max((i for i in md.storage_data.values() if i.relative_path == name), key=lambda i: i.length)
    raw = bytearray((step_dir / name).read_bytes())
    raw[info.offset + info.length // 2] ^= 0x40
    (step_dir / name).write_bytes(bytes(raw))


def test_a_shard_changed_after_verification_fails_the_load(tmp_path: Path, key_file: Path, key: SigningKey) -> None:
    """The check-then-read window: the manifest and every hash verify, then a shard changes before the load. The
    reader a resume uses hashes the bytes it deserializes and refuses; reading without that (what the load did
    before) takes the changed bytes silently."""
    root = tmp_path / "ckpt"
    _save(root, key_file, 2, job="mine")
    step_dir = root / "step_00000002"
    info = verify_checkpoint(step_dir, key=key)
    assert info.valid and info.manifest is not None
    _flip_inside_the_largest_item(step_dir, "__0_0.distcp")

    app = AppState(seed=1)
    with pytest.raises(CheckpointException) as err:
        dcp.load(app.state_dict(), storage_reader=CheckpointReader(step_dir, info.manifest["files"]),
                 planner=WeightsOnlyLoadPlanner(), no_dist=True)
    assert dcp_failure(err.value) == "checksum mismatch for __0_0.distcp (sha256 differs from the manifest)"

    unverified = AppState(seed=1)
    state = unverified.state_dict()
    dcp.load(state, storage_reader=CheckpointReader(step_dir, info.manifest["files"], verify_reads=False),
             planner=WeightsOnlyLoadPlanner(), no_dist=True)  # the window this closes: no error at all


def test_metadata_changed_after_verification_is_refused(tmp_path: Path, key_file: Path, key: SigningKey) -> None:
    """`.metadata` is hashed and unpickled from one read: a well-formed .metadata of another checkpoint put in its
    place after verification is refused."""
    root = tmp_path / "ckpt"
    _save(root, key_file, 4, job="mine")
    info = verify_checkpoint(root / "step_00000004", key=key)
    assert info.valid and info.manifest is not None
    shutil.copy(root / "step_00000002" / ".metadata", root / "step_00000004" / ".metadata")
    with pytest.raises(ShardstackError, match=r"^checksum mismatch for \.metadata \(sha256 differs from the "
                                              r"manifest\)$"):
        CheckpointReader(root / "step_00000004", info.manifest["files"]).read_metadata()


# --------------------------------------------------------------------------------------- through `train run`


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "corpus"
    prepare(None, out)
    return out


def _job(path: Path, data: Path, ckpt: Path, key_file: Path, *, lr: float = 3e-3, **top: Any) -> Path:
    cfg = {
        **top,
        "model": {"size": "tiny", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
        "data": {"path": str(data)},
        "engine": {"stage": 3, "device": "cpu"},
        "optimizer": {"lr": lr},
        "schedule": {"warmup_steps": 1, "total_steps": 8},
        "batch": {"global_batch": 2, "micro_batch": 2},
        "checkpoint": {"dir": str(ckpt), "interval": 2, "signing_key_file": str(key_file)},
        "metrics": {"port": 0},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli(["train", "run", *argv])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "Traceback" not in out, out
    return rc, out


def test_train_run_refuses_another_jobs_checkpoint_and_a_changed_config_in_one_line(
    tmp_path: Path, data_dir: Path, key_file: Path, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    ckpt = tmp_path / "ckpt"
    first = _job(tmp_path / "first.yaml", data_dir, ckpt, key_file)  # its job name: the file's stem
    rc, out = _train_run(capsys, "--config", str(first), "--max-steps", "2")
    assert rc == 0, out
    assert _manifest(ckpt / "step_00000002")["job"] == "first"

    rc, out = _train_run(capsys, "--config", str(_job(tmp_path / "second.yaml", data_dir, ckpt, key_file)))
    assert rc == 2
    assert (f"shardstack: error: checkpoint {ckpt / 'step_00000002'} belongs to job 'first', not to this job "
            "'second': refusing to resume it\n") in out, out

    changed = _job(tmp_path / "changed.yaml", data_dir, ckpt, key_file, lr=1e-3, name="first")
    rc, out = _train_run(capsys, "--config", str(changed), "--max-steps", "2")
    assert rc == 2 and f"checkpoint {ckpt / 'step_00000002'} of job 'first' was written with config hash" in out
    assert [s for s, _ in list_checkpoints(ckpt)] == [2]  # nothing trained or saved on top

    with caplog.at_level(logging.INFO, logger="shardstack.checkpoint"):
        rc, out = _train_run(capsys, "--config", str(changed), "--max-steps", "2", "--allow-config-change")
    assert rc == 0, out
    assert "resuming anyway (allow_config_change" in caplog.text
    assert f"resumed from {ckpt / 'step_00000002'} (step 2" in caplog.text
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 4]
    assert _manifest(ckpt / "step_00000004")["run_id"] == _manifest(ckpt / "step_00000002")["run_id"]


def test_the_job_name_is_checked_where_it_is_set(tmp_path: Path) -> None:
    from shardstack.ops import train as train_ops
    from shardstack.train.config import config_from_dict, job_name_from_path

    with pytest.raises(ShardstackError, match=r"config key 'name' is 'Not A Job'; expected a job name"):
        config_from_dict({"name": "Not A Job"})
    assert job_name_from_path(tmp_path / "run.v2.yaml") == "run-v2"  # as `train submit` names it
    with pytest.raises(ShardstackError, match=r"sets no name and its file name '_x' is not a job name"):
        job_name_from_path(tmp_path / "_x.yaml")
    # Refused before the inventory is even read: the config would name one job, its checkpoints another.
    with pytest.raises(ShardstackError, match=r"the job config names job 'a', but it is submitted as 'b'"):
        train_ops.submit({"name": "a"}, "b", tmp_path / "no-inventory")
