"""A job's model without ever holding all of it: built on the meta device, then — inside build_engine, after
sharding — materialised on each rank: its own shards only, filled by the seeded per-parameter init
(shardstack.model.init) or streamed from model.init_from's safetensors."""

from __future__ import annotations

import torch
from torch import nn

from shardstack.errors import ShardstackError
from shardstack.model.init import init_parameters, to_empty
from shardstack.model.spec import ModelConfig, build_model
from shardstack.train.engine import Materialize


def build_on_meta(cfg: ModelConfig, seed: int) -> tuple[nn.Module, Materialize]:
    """The model on the meta device, and how build_engine materialises it. A bad init_from directory or a model
    that cannot be initialised this way fails here, on every rank alike, before any allocation or collective."""
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.init_from:
        from shardstack.model import hf

        hf.check_weights(cfg.init_from, hf.read_config(cfg.init_from))
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ShardstackError(f"{type(model).__name__} has buffers ({', '.join(buffers[:3])}): a model built on the "
                              "meta device gets its parameters initialised, not its buffers",
                              hint="compute such tensors in forward (as the built-in Llama does for RoPE)")

    def materialize(module: nn.Module, device: torch.device) -> None:
        to_empty(module, device)
        if cfg.init_from:
            from shardstack.model.artifact import load_hf_weights

            load_hf_weights(module, cfg.init_from)
        else:
            init_parameters(module, seed)

    return model, materialize
