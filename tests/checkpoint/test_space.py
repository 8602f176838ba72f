"""The free-space check before each save, on real small filesystems (tmpfs mounted for the test; `make test` runs as
root): a save that does not fit is skipped with a warning and a metric, training goes on, every rank agrees."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from shardstack.train import dist
from shardstack.train.checkpoint.layout import MANIFEST, list_checkpoints
from shardstack.train.checkpoint.space import SPACE_MARGIN_BYTES, SPACE_MARGIN_RATIO, SpaceCheck
from shardstack.train.config import MetricsConfig, config_from_dict
from shardstack.train.data import prepare
from shardstack.train.metrics import MetricsProcessor
from shardstack.train.trainer import train

from .conftest import HERE, AppState, make_checkpointer, torchrun

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MiB = 2**20


@contextlib.contextmanager
def tmpfs(where: Path, size_mib: int) -> Iterator[Path]:
    where.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"cannot mount a {size_mib} MiB tmpfs at {where} (needs root): {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _fill(where: Path, leave_free: int) -> None:
    """Write a ballast file so that `leave_free` bytes (to the page) remain free on `where`'s filesystem."""
    ballast = where / "ballast"
    size = (ballast.stat().st_size if ballast.exists() else 0) + shutil.disk_usage(where).free - leave_free
    with open(ballast, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * size)  # tmpfs allocates on write, not on truncate


def test_a_save_that_does_not_fit_is_skipped_and_the_estimate_follows_the_last_checkpoint(
    tmp_path: Path, key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checks: list[SpaceCheck] = []
    with tmpfs(tmp_path / "fs", 96) as fs:
        app = AppState()
        ckpt = make_checkpointer(fs / "ckpt", key_file, interval=1, keep=1)
        ckpt.on_space_check = checks.append
        ckpt.resume(app)
        app.train(1)
        assert ckpt.maybe_save(1, app)  # 96 MiB holds one tiny checkpoint plus the margin
        total = json.loads((fs / "ckpt" / "step_00000001" / MANIFEST).read_text())["total_bytes"]
        # Before any checkpoint exists the estimate is the state's tensor bytes: most of what was written (DCP's
        # per-item framing, ~1 KiB each, weighs on a model this tiny), and with the margin more than all of it.
        first_estimate = (checks[0].needed_bytes - SPACE_MARGIN_BYTES) / (1 + SPACE_MARGIN_RATIO)
        assert 0.6 * total <= first_estimate <= total <= checks[0].needed_bytes

        needed = int(total * (1 + SPACE_MARGIN_RATIO)) + SPACE_MARGIN_BYTES  # from the last committed checkpoint
        _fill(fs, needed - MiB)
        with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
            app.train(1)
            assert not ckpt.maybe_save(2, app)
        assert checks[-1] == SpaceCheck(step=2, free_bytes=shutil.disk_usage(fs).free, needed_bytes=needed,
                                        skipped=True)
        assert ckpt.skipped_saves == 1 and [s for s, _ in list_checkpoints(fs / "ckpt")] == [1]
        assert f"skipping the checkpoint of step 2: {fs / 'ckpt'} has" in caplog.text
        assert "training goes on, the newest checkpoint stays step 1" in caplog.text
        assert not list((fs / "ckpt").glob("*.tmp-*"))  # nothing was started

        _fill(fs, needed + MiB)  # room again: the next save goes through and keep prunes the older one
        app.train(1)
        assert ckpt.maybe_save(3, app) and not checks[-1].skipped
        assert [s for s, _ in list_checkpoints(fs / "ckpt")] == [3]
        resumed = AppState(seed=4)
        assert make_checkpointer(fs / "ckpt", key_file).resume(resumed) == 3


def test_the_trainer_keeps_training_when_no_checkpoint_fits_and_logs_each_skip(
    tmp_path: Path, key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    prepare(None, data)
    with tmpfs(tmp_path / "fs", 16) as fs:  # less than the margin alone: every save is skipped
        cfg = config_from_dict({
            "name": "space",
            "model": {"size": "tiny", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
            "data": {"path": str(data)}, "engine": {"stage": 3, "device": "cpu"},
            "batch": {"global_batch": 2, "micro_batch": 2}, "schedule": {"warmup_steps": 1, "total_steps": 4},
            "checkpoint": {"dir": str(fs / "ckpt"), "interval": 2, "signing_key_file": str(key_file)},
            "metrics": {"port": 0, "peak_tflops": 1.0},
        })
        dist.init_distributed("cpu")
        try:
            with caplog.at_level(logging.WARNING, logger="shardstack.checkpoint"):
                result = train(cfg, out=StringIO())
        finally:
            dist.shutdown()
        assert result.steps == [1, 2, 3, 4]
        assert [r.getMessage().split(":")[0] for r in caplog.records if "skipping the checkpoint" in r.getMessage()] \
            == ["skipping the checkpoint of step 2", "skipping the checkpoint of step 4"]
        assert list_checkpoints(fs / "ckpt") == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_skipped_saves_and_free_bytes_reach_prometheus() -> None:
    import torch

    port = _free_port()
    m = MetricsProcessor(MetricsConfig(port=port, peak_tflops=1.0), is_main=True, device=torch.device("cpu"),
                         world_size=1, tokens_per_step=1, flops_per_token=1.0)
    try:
        m.checkpoint_space(free_bytes=5 * MiB, skipped=False)
        m.checkpoint_space(free_bytes=3 * MiB, skipped=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    samples = dict(line.split(" ") for line in body.splitlines() if line.startswith("shardstack_train_checkpoint"))
    assert float(samples["shardstack_train_checkpoint_skipped_total"]) == 1
    assert float(samples["shardstack_train_checkpoint_free_bytes"]) == 3 * MiB


@pytest.mark.distributed
def test_every_rank_skips_together_and_none_hangs(tmp_path: Path, key_file: Path) -> None:
    with tmpfs(tmp_path / "fs", 16) as fs:
        rc, out = torchrun(2, str(HERE / "fsdp_worker.py"), "--ckpt", str(fs / "ckpt"), "--steps", "4",
                           "--interval", "2", "--key-file", str(key_file), "--out", str(tmp_path / "losses.json"),
                           timeout=240)
        assert rc == 0, out[-4000:]
        skips = [line for line in out.splitlines() if "skipping the checkpoint of step" in line]
        assert len(skips) == 2 and "step 2" in skips[0] and "step 4" in skips[1], out[-4000:]  # rank 0 logs each
        assert list_checkpoints(fs / "ckpt") == []
        assert json.loads((tmp_path / "losses.json").read_text())["losses"].keys() == {"1", "2", "3", "4"}
    assert not os.path.ismount(tmp_path / "fs")
