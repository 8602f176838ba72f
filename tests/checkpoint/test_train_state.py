"""The trainer's TrainState through a real save and resume: model and optimizer as tensors, everything else as plain
data (no pickled objects), and the RNG, scheduler, sampler and step restored exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.spec import build_model
from shardstack.train import dist
from shardstack.train.config import config_from_dict
from shardstack.train.data import GlobalSampler
from shardstack.train.engine import build_engine
from shardstack.train.optim import make_scheduler
from shardstack.train.trainer import TrainState

from .conftest import make_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


@pytest.fixture
def world1():
    info = dist.init_distributed("cpu")
    yield info
    dist.shutdown()


def _state(info, seed: int) -> TrainState:
    cfg = config_from_dict({"model": {"size": "tiny", "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
                            "engine": {"stage": 3, "device": "cpu"}, "schedule": {"warmup_steps": 2,
                                                                                  "total_steps": 10}})
    torch.manual_seed(seed)
    engine = build_engine(build_model(cfg.model), cfg.engine, cfg.optimizer, info)
    sampler = GlobalSampler(1000, global_batch=4, world_size=1, rank=0, seed=7)
    return TrainState(engine, make_scheduler(engine.optimizer, cfg.schedule), sampler)


def _draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.Tensor)


def test_train_state_round_trips_through_a_checkpoint_as_plain_data(
    world1, tmp_path: Path, key_file: Path
) -> None:
    saved = _state(world1, seed=0)
    for _ in range(3):
        saved.scheduler.step()
    saved.step, saved.sampler.sample_index = 3, 12
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    _draws()  # move the generators off their seeded start
    sd = saved.state_dict()
    assert _plain(sd) and isinstance(sd["train"], str) and json.loads(sd["train"])["step"] == 3
    ckpt = make_checkpointer(tmp_path, key_file, interval=3)
    ckpt.save(3, saved)
    expected = _draws()

    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    resumed = _state(world1, seed=5)
    assert make_checkpointer(tmp_path, key_file).resume(resumed) == 3
    assert resumed.step == 3 and resumed.sampler.sample_index == 12
    assert resumed.scheduler.state_dict() == saved.scheduler.state_dict()
    assert _draws() == expected
    for a, b in zip(saved.engine.module.parameters(), resumed.engine.module.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)


def test_malformed_training_state_is_a_clear_error(world1) -> None:
    state = _state(world1, seed=0)
    sd = state.state_dict()
    train = json.loads(sd["train"])
    without_rng = {k: v for k, v in train.items() if k != "numpy_rng"}
    with pytest.raises(ShardstackError, match=r"the checkpoint's training state is malformed \('numpy_rng'\)"):
        state.load_state_dict({**sd, "train": json.dumps(without_rng)})
    with pytest.raises(ShardstackError, match=r"malformed \(step is -1\)"):
        state.load_state_dict({**sd, "train": json.dumps({**train, "step": -1})})
