"""A model directory in the export format with seeded random weights: for tests and the benchmark, and to
try the service before a training run has produced a real export."""

from __future__ import annotations

from pathlib import Path

import torch

from shardstack.model.artifact import save_model
from shardstack.model.gpt import GPT, PRESETS, GPTConfig


def write_random_model(out: str | Path, preset: str = "small", *, seed: int = 0, **overrides: int) -> Path:
    """Write the artifact (model.safetensors + config.json) exactly as `shardstack export` lays it out."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**PRESETS[preset], **overrides}))
    return save_model(model, out, step=0, source=f"random:{preset}:seed={seed}")
