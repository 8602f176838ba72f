"""`micro_batch: auto` agrees across ranks: each rank's trial has no collective, so a rank that runs out of memory
still reaches the one all-reduce per candidate, and every rank picks the size that fits the tightest rank. The
memory limit is a real one per rank (RLIMIT_DATA on CPU), not a stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.train.config import config_from_dict
from shardstack.train.dist import init_distributed
from shardstack.train.engine import build_engine
from shardstack.train.memory.autobatch import (
    OK,
    OUT_OF_MEMORY,
    Recomputed,
    divisors_desc,
    find_micro_batch,
    replica,
    trial,
)

WORKER = Path(__file__).parent / "workers" / "autobatch_worker.py"
TINY = {"size": "tiny", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256}


@pytest.fixture(scope="module")
def world1():
    return init_distributed("cpu")


def test_the_replica_has_every_layer_but_one_block_of_weights(world1) -> None:
    cfg = config_from_dict({"model": TINY, "engine": {"stage": 3, "precision": "bf16"}})
    torch.manual_seed(0)
    engine = build_engine(GPT(GPTConfig(**{k: v for k, v in TINY.items() if k != "size"})), cfg.engine,
                          cfg.optimizer, world1)
    model = replica(cfg, engine)
    assert len(model.blocks) == 2 and model.blocks[0] is model.blocks[1]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # FSDP2 computes in the compute dtype
    assert trial(model, engine, 2, 32, 256, 0, 1 << 30) == (OK, "fits")
    code, what = trial(model, engine, 2, 32, 256, 1 << 30, 1 << 20)  # a 1 GiB reservation under a 1 MiB limit
    assert code == OUT_OF_MEMORY and "can't allocate memory" in what
    assert trial(model, engine, 2, 32, 256, 0, 1 << 30)[0] == OK  # the limit was lifted again


def test_the_replica_recomputes_where_the_engine_does(world1) -> None:
    """every_n 2 over 3 layers recomputes places 0 and 2 (the one shared block inside), and autograd keeps less."""
    tiny = {**TINY, "n_layer": 3}
    cfg = config_from_dict({"model": tiny, "engine": {"stage": 0, "activation_checkpointing": "every_n",
                                                      "activation_checkpointing_every": 2}})
    torch.manual_seed(0)
    engine = build_engine(GPT(GPTConfig(**{k: v for k, v in tiny.items() if k != "size"})), cfg.engine,
                          cfg.optimizer, world1)
    model = replica(cfg, engine)
    assert [type(b) for b in model.blocks] == [Recomputed, type(model.blocks[1]), Recomputed]
    assert model.blocks[0].block is model.blocks[1] is model.blocks[2].block
    plain = replica(config_from_dict({"model": tiny}), engine)

    def saved(m: torch.nn.Module) -> int:
        sizes: list[int] = []
        x = torch.randint(0, 256, (2, 32))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            m(x, x)
        return sum(sizes)

    assert saved(model) < saved(plain)
    assert trial(model, engine, 2, 32, 256, 0, 1 << 30) == (OK, "fits")


def test_a_single_rank_takes_the_largest_candidate_that_fits(world1) -> None:
    cfg = config_from_dict({"model": TINY, "batch": {"global_batch": 16, "micro_batch": "auto"}})
    torch.manual_seed(0)
    engine = build_engine(GPT(GPTConfig(**{k: v for k, v in TINY.items() if k != "size"})), cfg.engine,
                          cfg.optimizer, world1)
    assert divisors_desc(16) == [16, 8, 4, 2, 1]
    assert find_micro_batch(cfg, engine, 32, 256, budget=1 << 34) == 16
    # A budget below the optimizer state the step will add (tens of MiB: more than the allocator keeps free)
    wide = {**TINY, "d_model": 512, "n_head": 4}
    cfg = config_from_dict({"model": wide, "batch": {"global_batch": 16, "micro_batch": "auto"}})
    engine = build_engine(GPT(GPTConfig(**{k: v for k, v in wide.items() if k != "size"})), cfg.engine,
                          cfg.optimizer, world1)
    with pytest.raises(ShardstackError, match="not even micro_batch 1 fits the memory budget"):
        find_micro_batch(cfg, engine, 32, 256, budget=engine.memory_breakdown()["total"])


@pytest.mark.distributed
def test_ranks_agree_when_only_one_runs_out_of_memory() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for stage in (3, 0):
        picked = {r["rank"]: r["micro_batch"] for r in rows if r["stage"] == stage}
        assert picked == {0: 4, 1: 4}, rows  # rank 0 alone would take 8
    assert proc.stderr.count("rank 1: micro-batch 8: RuntimeError") == 2 and "rank 0: micro-batch" not in proc.stderr
    assert proc.stderr.count("micro-batch 8 does not fit on some rank; backing off") == 2
