"""A model directory with seeded random weights, in either export format: for tests and benchmarks, and to try the
service before a training run has produced a real export. (`shardstack/pretrained/stdlib-llama` is a trained one.)"""

from __future__ import annotations

from pathlib import Path

import torch

from shardstack.model.artifact import save_model
from shardstack.model.spec import ARCHS, build_arch
from shardstack.model.tokenizer import HFTokenizer


def write_random_model(out: str | Path, preset: str = "small", *, seed: int = 0, arch: str = "gpt",
                       tokenizer: str | Path | None = None, fmt: str = "shardstack", **overrides: int) -> Path:
    """Write a random `arch` model of `preset` (with `overrides`) exactly as `shardstack export --format fmt` lays it
    out. With `tokenizer` (a directory holding tokenizer.json) its files are included and the vocabulary is its
    size; without, the model is byte-level."""
    tok = HFTokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None:
        overrides.setdefault("vocab_size", tok.vocab_size)
    torch.manual_seed(seed)
    model = build_arch(arch, {**ARCHS[arch].presets[preset], **overrides})
    return save_model(model, out, step=0, source=f"random:{arch}:{preset}:seed={seed}", fmt=fmt, tokenizer=tok)
