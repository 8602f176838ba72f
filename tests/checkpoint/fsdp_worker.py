"""A plain FSDP2 training loop around `Checkpointer`, run under torchrun by the checkpoint tests.

It does not use the trainer: model + AdamW + `fully_shard` per block, an app state built on torch's
get_state_dict/set_state_dict, and a global batch that is a pure function of the step, split evenly across ranks,
so a run's loss sequence does not depend on the world size. Rank 0 writes the per-step losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.train.checkpoint.checkpointer import Checkpointer
from shardstack.train.config import CheckpointConfig
from shardstack.train.dist import leave_worker
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
MODEL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


class AppState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        self.step = sd["step"]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.seq_len + 1), generator=g)
    per = GLOBAL_BATCH // world
    local = data[rank * per : (rank + 1) * per]
    return local[:, :-1].contiguous(), local[:, 1:].contiguous()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--resume", default="auto")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--key-file", help="the signing key; without it, checkpoints are unsigned")
    p.add_argument("--out")
    p.add_argument("--dump-full", help="torch.save the gathered full model state dict here at the end (rank 0)")
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(MODEL)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    app = AppState(model, optimizer)
    cfg = CheckpointConfig(dir=args.ckpt, interval=args.interval, keep=args.keep, resume=args.resume,
                           async_save=args.async_save, signing_key_file=args.key_file or "",
                           require_signature=args.key_file is not None)
    ckpt = Checkpointer(cfg, config_hash="test", job="fsdp", dist=SimpleNamespace(rank=rank, world_size=world), stage=3,
                        job_config={"model": MODEL.to_dict()})
    start = ckpt.resume(app)
    losses: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        losses[step] = loss.item()
        app.step = step
        ckpt.maybe_save(step, app)
    ckpt.finish(args.steps, app)
    if args.dump_full:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.dump_full)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"start": start, "losses": losses, "world": world}, f)
    dist.destroy_process_group()
    leave_worker(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
