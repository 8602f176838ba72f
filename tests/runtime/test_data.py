"""Token shards and the global-index sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.train.data import Batches, GlobalSampler, TokenDataset, prepare


def test_prepare_shipped_corpus(tmp_path):
    meta = prepare(None, tmp_path)
    assert meta["tokenizer"] == "bytes" and 500_000 < meta["total_tokens"] < 2_100_000
    tokens = np.fromfile(tmp_path / meta["shards"][0]["file"], dtype=np.uint16)
    assert bytes(tokens[:200].astype(np.uint8)) in meta_source_bytes(meta)


def meta_source_bytes(meta) -> bytes:
    return open(meta["sources"][0], "rb").read()


def test_prepare_splits_shards_and_windows_stay_inside(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_bytes(bytes(range(256)) * 4)  # 1024 tokens
    (src / "b.txt").write_bytes(b"xyz" * 100)  # 300 tokens
    meta = prepare(src, tmp_path / "out", shard_tokens=500)
    assert [s["tokens"] for s in meta["shards"]] == [500, 500, 324]
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["total_tokens"] == 1324
    ds = TokenDataset(tmp_path / "out", seq_len=9)
    assert len(ds) == 55 + 55 + 35
    assert ds[0].tolist() == list(range(10))
    assert ds[55].tolist() == [(500 + i) % 256 for i in range(10)]  # second shard starts a fresh window


def test_prepare_errors(tmp_path):
    with pytest.raises(ShardstackError, match="does not exist"):
        prepare(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "tiny.txt").write_text("abc")
    prepare(tmp_path / "tiny.txt", tmp_path / "out")
    with pytest.raises(ShardstackError, match="fewer than"):
        TokenDataset(tmp_path / "out", seq_len=8)


def _stream(world: int, steps: int, global_batch: int = 8, start: int = 0) -> list[list[int]]:
    samplers = [GlobalSampler(37, global_batch=global_batch, world_size=world, rank=r, seed=3,
                              sample_index=start) for r in range(world)]
    return [[i for s in samplers for i in s.next_indices()] for _ in range(steps)]


def test_global_stream_is_world_size_independent():
    assert _stream(1, 10) == _stream(2, 10) == _stream(4, 10)
    # Crossing epochs: every sample once per epoch, a new order each epoch.
    flat = [i for step in _stream(1, 10) for i in step]
    assert sorted(flat[:37]) == list(range(37)) and flat[37:74] != flat[:37]


def test_resume_continues_the_stream_on_another_world_size():
    a = GlobalSampler(37, global_batch=8, world_size=2, rank=0, seed=3)
    for _ in range(3):
        a.next_indices()
    state = a.state_dict()
    assert state["sample_index"] == 24
    resumed = [GlobalSampler(37, global_batch=8, world_size=4, rank=r, seed=3) for r in range(4)]
    for s in resumed:
        s.load_state_dict(state)
    assert [[i for s in resumed for i in s.next_indices()]] == _stream(1, 4)[3:]
    with pytest.raises(ShardstackError, match="data stream"):
        GlobalSampler(40, global_batch=8, world_size=1, rank=0, seed=3).load_state_dict(state)


def test_batches_shapes_and_shift(tmp_path):
    prepare(None, tmp_path)
    ds = TokenDataset(tmp_path, seq_len=16)
    sampler = GlobalSampler(len(ds), global_batch=8, world_size=2, rank=1, seed=0)
    mbs = Batches(ds, sampler, micro_batch=2, device=torch.device("cpu")).next_step()
    assert len(mbs) == 2 and all(x.shape == (2, 16) for x, _ in mbs)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in mbs)
    with pytest.raises(ShardstackError, match="does not divide"):
        Batches(ds, sampler, micro_batch=3, device=torch.device("cpu"))
