"""A user model plugged in through `model.factory: user_model:make` (the test puts this directory on sys.path)."""

from shardstack.model.gpt import GPT, GPTConfig
from torch import nn


class Wide(GPT):
    """Any nn.Module with forward(idx, targets) -> loss and `blocks` works; this one just changes the MLP ratio."""


def make(layers: int = 2, width: int = 48) -> nn.Module:
    return Wide(GPTConfig(n_layer=layers, n_head=2, d_model=width, seq_len=16, mlp_ratio=2))
