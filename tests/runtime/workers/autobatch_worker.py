"""torchrun worker for tests/runtime/test_autobatch.py: two gloo ranks pick `micro_batch: auto` for ZeRO stage 3
(FSDP2) and stage 0 (DDP) under per-rank memory budgets. Rank 0 may use anything; rank 1's budget lies halfway
between the least under which micro-batch 4's trial fits and the least for 8 (each found by bisection on its own
trial; halfway, because the heap's slack moves either by a MiB or so), so 8 runs out of memory there alone.
Each rank prints one JSON line per stage."""

from __future__ import annotations

import json
import logging
import sys

import torch
from shardstack.model.spec import build_model
from shardstack.train.config import config_from_dict
from shardstack.train.dist import init_distributed, leave_worker, shutdown
from shardstack.train.engine import build_engine
from shardstack.train.memory import autobatch

# Activations dominate (long sequences, few parameters), so the candidates differ by megabytes.
MODEL = {"size": "tiny", "n_layer": 2, "n_head": 4, "d_model": 256, "seq_len": 256, "vocab_size": 256}


def least_budget(cfg, engine, model, mb: int) -> int:
    lo, hi = 0, 1 << 32
    while hi - lo > 1 << 18:  # 256 KiB
        mid = (lo + hi) // 2
        code, _ = autobatch.try_micro_batch(cfg, engine, model, mb, 256, 256, mid)
        lo, hi = (lo, mid) if code == autobatch.OK else (mid, hi)
    return hi


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    info = init_distributed("cpu")
    for stage in (3, 0):
        cfg = config_from_dict({"model": MODEL, "engine": {"stage": stage},
                                "batch": {"global_batch": 16, "micro_batch": "auto"}})
        torch.manual_seed(0)
        engine = build_engine(build_model(cfg.model), cfg.engine, cfg.optimizer, info)
        budget = 1 << 40
        if info.rank == 1:
            model = autobatch.replica(cfg, engine)
            need4, need8 = least_budget(cfg, engine, model, 4), least_budget(cfg, engine, model, 8)
            assert need8 - need4 > 4 << 20, (need4, need8)  # far enough apart for the heap's slack
            budget = (need4 + need8) // 2
            alone = {mb: autobatch.try_micro_batch(cfg, engine, model, mb, 256, 256, budget)[0] for mb in (8, 4)}
            assert alone == {8: autobatch.OUT_OF_MEMORY, 4: autobatch.OK}, alone
            del model
        mb = autobatch.find_micro_batch(cfg, engine, 256, 256, budget=budget)
        # One write per line: print() writes the text and the newline apart, and the two ranks share the pipe.
        line = json.dumps({"stage": stage, "rank": info.rank, "micro_batch": mb, "budget": budget}) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        del engine
    shutdown()
    leave_worker(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
