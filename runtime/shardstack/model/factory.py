"""What a job's `model:` section says, and the module built from it: the built-in GPT from a preset plus
overrides, or the user's `package.module:factory`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardstack.errors import ShardstackError
from shardstack.model.gpt import GPT, PRESETS, GPTConfig

_OVERRIDES = ("n_layer", "n_head", "d_model", "seq_len", "mlp_ratio", "vocab_size", "dropout", "bias",
              "tie_embeddings")


@dataclass
class ModelConfig:
    size: str = "small"  # a key of PRESETS; the fields below override it
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    mlp_ratio: int | None = None
    vocab_size: int | None = None
    dropout: float | None = None
    bias: bool | None = None
    tie_embeddings: bool | None = None
    # A user model instead of the built-in GPT: "package.module:factory", called as factory(**factory_kwargs).
    # It must return an nn.Module whose forward(idx, targets) returns the mean loss and with `blocks` (its shard units).
    factory: str | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)


def gpt_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The GPTConfig fields for `cfg`: the preset's values with the explicit overrides applied."""
    out: dict[str, Any] = dict(PRESETS[cfg.size])
    for name in _OVERRIDES:
        value = getattr(cfg, name)
        if value is not None:
            out[name] = value
    return out


def build_model(cfg: ModelConfig) -> nn.Module:
    """The built-in GPT from preset + overrides, or the user's `module:factory(**factory_kwargs)`, on the current
    default device (callers pick it with `with torch.device(...)`)."""
    if cfg.factory:
        mod_name, _, fn_name = cfg.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ShardstackError(f"config key 'model.factory': cannot load {cfg.factory!r} ({exc})") from None
        model = factory(**cfg.factory_kwargs)
        if not isinstance(model, nn.Module):
            raise ShardstackError(f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
        return model
    try:
        return GPT(GPTConfig(**gpt_fields(cfg)))
    except ValueError as exc:
        raise ShardstackError(f"config section 'model': {exc}") from None
