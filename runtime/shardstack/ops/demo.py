"""The demo's job (also the e2e's): what `shardstack demo` trains on the lab."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def demo_job(steps: int, shared_dir: str, name: str = "demo", *, init_from: str | None = None) -> dict[str, Any]:
    """The demo's job (also the e2e's): ZeRO stage 3 (FSDP2) across 2 nodes on CPU, on the shipped corpus. With
    `init_from` (a Hugging Face directory every train node sees, e.g. the pretrained model `storage.place_model` put
    on shared storage) it fine-tunes that model, the corpus prepared with its tokenizer; without, it trains a tiny
    byte-level GPT from scratch."""
    from shardstack.train.config import config_from_dict

    if init_from is None:
        model: dict[str, Any] = {"size": "tiny"}
        data: dict[str, Any] = {"path": f"{shared_dir}/data/corpus"}
        lr, warmup = 3e-3, min(20, steps // 10)
    else:
        model = {"init_from": init_from}
        data = {"path": f"{shared_dir}/data/corpus-{Path(init_from).name}", "tokenizer": init_from}
        # A model pretrained on this corpus: a tenth of its peak learning rate, a short warm-up.
        lr, warmup = 3e-4, min(10, steps // 10)
    cfg = {
        "model": model,
        "data": data,
        "engine": {"stage": 3, "device": "auto"},
        "optimizer": {"lr": lr},
        "schedule": {"warmup_steps": warmup, "total_steps": steps},
        "batch": {"global_batch": 8, "micro_batch": 4},
        "checkpoint": {"dir": f"{shared_dir}/checkpoints/{name}", "interval": max(10, steps // 6), "keep": 2},
        "metrics": {"port": 9400, "log_every": 10},
    }
    return config_from_dict(cfg).to_dict()
