"""Run under torchrun: the trainer's build path for a ~1.05 GiB Llama at ZeRO-3, measuring this process's peak
resident memory (VmHWM, /proc/self/status) after each phase. Writes OUT/rank{r}.json.

mode "meta": what the trainer does (build_on_meta → build_engine materialising the local shards), then one step.
mode "eager": the path before meta-device init (the whole model built and initialised on every rank, then sharded);
init only — it shows what the meter reads when a rank does hold the full model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from shardstack.model.spec import ModelConfig, build_model
from shardstack.train.build import build_on_meta
from shardstack.train.config import EngineConfig, OptimizerConfig
from shardstack.train.dist import init_distributed, leave_worker, shutdown
from shardstack.train.engine import build_engine
from shardstack.train.memory.estimate import estimate_stage
from shardstack.train.memory.host import tune_allocator

# 282 M parameters (fp32: 1.05 GiB). A small vocabulary keeps the root unit (embeddings + head), which FSDP2 keeps
# gathered through forward and backward, a small part of the whole.
MODEL = ModelConfig.of(arch="llama", n_layer=22, n_head=16, n_kv_head=4, d_model=1024, ffn_dim=3072, vocab_size=8192,
                       seq_len=64)
MICRO_BATCH = 1


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tune_allocator()  # as the trainer does on CPU
    info = init_distributed("cpu")
    with torch.device("meta"):
        torch.nn.Linear(1, 1)  # the modules torch loads for its meta device belong to the baseline, not the model
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS: the baseline is the interpreter, torch and the process group
    res = {"baseline": status("VmRSS")}
    if mode == "meta":
        model, materialize = build_on_meta(MODEL, seed=0)
        engine = build_engine(model, EngineConfig(stage=3), OptimizerConfig(), info, materialize=materialize)
    else:
        torch.manual_seed(0)
        model = build_model(MODEL)
        engine = build_engine(model, EngineConfig(stage=3), OptimizerConfig(), info)
    res["params"] = sum(p.numel() for p in engine.module.parameters())
    res["init"] = status("VmHWM")
    if mode == "meta":
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, MODEL.overrides.vocab_size, (MICRO_BATCH, MODEL.overrides.seq_len + 1), generator=g)
        res["loss"] = engine.forward_backward([(x[:, :-1], x[:, 1:])])
        res["forward_backward"] = status("VmHWM")
        engine.step()
        res["step"] = status("VmHWM")
        est = estimate_stage(engine.module, EngineConfig(stage=3), 3, info.world_size, info.rank,
                             weight_decay=OptimizerConfig().weight_decay, micro_batch=MICRO_BATCH,
                             seq_len=MODEL.overrides.seq_len)
        res["estimated_first_step_peak"], res["optimizer_impl"] = est.first_step_peak, est.optimizer_impl
    (out / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown()
    leave_worker(0)


if __name__ == "__main__":
    main()
