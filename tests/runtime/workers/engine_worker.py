"""Run under torchrun (2 ranks, gloo, CPU): every ZeRO stage on the same tiny GPT, seed and data.

Writes OUT/rank{r}.pt with, per stage: losses, grad norms, full parameters, measured local bytes and the
estimator's prediction for this rank; rank 0 also trains a plain single-process reference on the whole global
batch; and DCP round trips between stages (3 → 1 and 1 → 2) with one more step on each side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.train.config import EngineConfig, OptimizerConfig
from shardstack.train.dist import init_distributed, leave_worker, shutdown
from shardstack.train.engine import build_engine
from shardstack.train.memory.estimate import estimate_stage
from shardstack.train.optim import optimizer_param_groups
from torch.distributed.tensor import DTensor

MODEL = GPTConfig(n_layer=2, n_head=3, d_model=36, seq_len=15, vocab_size=256)  # pos_emb 15 rows: uneven shards
OPTIM = OptimizerConfig(lr=1e-2, grad_clip=0.5, weight_decay=0.1)
STEPS, GLOBAL, MICRO = 5, 8, 2


def global_batches(steps: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.seq_len + 1), generator=g) for _ in range(steps)]


def rank_micro_batches(batch: torch.Tensor, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mine = batch.chunk(world)[rank]
    return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in mine.split(MICRO)]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def new_engine(stage: int, info, seed: int = 0, **engine_kwargs):
    torch.manual_seed(seed)
    return build_engine(GPT(MODEL), EngineConfig(stage=stage, **engine_kwargs), OPTIM, info)


def run_stage(stage: int, info, data, **engine_kwargs) -> tuple[dict, object]:
    eng = new_engine(stage, info, **engine_kwargs)
    losses, norms = [], []
    for batch in data:
        losses.append(eng.forward_backward(rank_micro_batches(batch, info.rank, info.world_size)))
        norms.append(eng.step(measure=True).grad_norm)
    est = estimate_stage(eng.module, eng.cfg, stage, info.world_size, info.rank, weight_decay=OPTIM.weight_decay,
                         micro_batch=MICRO, seq_len=MODEL.seq_len)
    params = {k: full(v) for k, v in eng.module.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "measured": eng.last_memory,
            "estimated": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                          "total": est.total}}, eng


def reference(data) -> dict:
    """Plain PyTorch, one process, the whole global batch in GLOBAL/MICRO micro-batches."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(optimizer_param_groups(model, OPTIM.weight_decay), lr=OPTIM.lr,
                            betas=tuple(OPTIM.betas), eps=OPTIM.eps)
    losses = []
    for batch in data:
        mbs = rank_micro_batches(batch, 0, 1)
        total = 0.0
        for x, y in mbs:
            loss = model(x, y)
            (loss / len(mbs)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / len(mbs))
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def round_trip(src_eng, dst_stage: int, info, ckpt: Path, extra) -> dict:
    """Save src with DCP, load into a freshly initialised engine of another stage, then one step on both."""
    dcp.save(src_eng.state_dict(), checkpoint_id=str(ckpt))
    dst = new_engine(dst_stage, info, seed=123)  # different init: the load must overwrite everything
    sd = dst.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpt))
    dst.load_state_dict(sd)
    loaded = {k: full(v) for k, v in dst.module.named_parameters()}
    mbs = rank_micro_batches(extra, info.rank, info.world_size)
    loss_src = src_eng.forward_backward(mbs)
    src_eng.step()
    loss_dst = dst.forward_backward(mbs)
    dst.step()
    after_src = {k: full(v) for k, v in src_eng.module.named_parameters()}
    after_dst = {k: full(v) for k, v in dst.module.named_parameters()}
    return {"loaded": loaded, "loss_src": loss_src, "loss_dst": loss_dst, "after_src": after_src,
            "after_dst": after_dst}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    data = global_batches(STEPS + 2)
    res: dict = {"world_size": info.world_size, "stages": {}}
    engines = {}
    for stage in range(4):
        res["stages"][stage], engines[stage] = run_stage(stage, info, data[:STEPS])
    # The other accumulation semantics and explicit prefetch must not change the math.
    for name, stage, kwargs in [("0-every", 0, {"accumulation_sync": "every"}),
                                ("3-every", 3, {"accumulation_sync": "every"}),
                                ("2-every", 2, {"accumulation_sync": "every"}),
                                ("3-prefetch2", 3, {"prefetch": 2})]:
        res["stages"][name] = run_stage(stage, info, data[:STEPS], **kwargs)[0]
    res["trip_3_to_1"] = round_trip(engines[3], 1, info, out / "ckpt31", data[STEPS])
    res["trip_1_to_2"] = round_trip(engines[1], 2, info, out / "ckpt12", data[STEPS + 1])
    if info.rank == 0:
        res["reference"] = reference(data[:STEPS])
    torch.save(res, out / f"rank{info.rank}.pt")
    shutdown()
    leave_worker(0)


if __name__ == "__main__":
    main()
