"""A model directory in the export format with seeded random weights: for tests and the benchmark, and to
try the service before a training run has produced a real export."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardstack.model import GPT, PRESETS, GPTConfig


def write_random_model(out: str | Path, preset: str = "small", *, seed: int = 0, **overrides: int) -> Path:
    """Write OUT/model.safetensors + OUT/config.json exactly as `shardstack export` lays them out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**PRESETS[preset], **overrides}))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["lm_head.weight"]  # stored once, as tok_emb.weight
    save_file(state, out / "model.safetensors")
    meta = {"model": model.config.to_dict(), "step": 0, "dtype": "float32",
            "source_checkpoint": f"random:{preset}:seed={seed}", "tokenizer": "bytes"}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
