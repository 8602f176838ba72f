"""The KV cache the serving scheduler decodes with: one key/value buffer pair per layer, one slot per sequence.

A `LayerCache` is one layer's view for one forward call: where each row writes and what it may attend to, so a
batch can mix sequences of different lengths (continuous batching).
"""

from __future__ import annotations

from typing import Protocol

import torch


class CacheShape(Protocol):
    n_layer: int
    n_kv_head: int  # keys/values per layer: fewer than the query heads under grouped-query attention
    head_dim: int


class KVCache:
    """Key/value buffers for `slots` sequences of up to `max_len` tokens each, one pair per layer."""

    def __init__(self, config: CacheShape, slots: int, max_len: int, *, dtype: torch.dtype, device) -> None:
        shape = (config.n_layer, slots, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len


class Step:
    """Where one forward call's rows write and what they may attend to: the same for every layer, so built once
    (the [B, 1, T, L] mask of a long prefill chunk is the largest transient tensor of a step)."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, t: int, dense: bool) -> None:
        self.dense = dense  # rows are slots 0..B-1 in order: attend through a view, no gather
        offsets = torch.arange(t, device=positions.device)
        self.rows = slots[:, None].expand(-1, t)
        self.cols = positions[:, None] + offsets  # [B, T] absolute position of each new token
        self.length = int(self.cols.max()) + 1
        keys = torch.arange(self.length, device=positions.device)
        self.mask = (keys[None, None, :] <= self.cols[:, :, None])[:, None]  # [B, 1, T, L]


class LayerCache:
    """One layer's view of a KVCache for one forward call."""

    def __init__(self, cache: KVCache, layer: int, step: Step) -> None:
        self.k, self.v = cache.k[layer], cache.v[layer]
        self.dense, self.rows, self.cols = step.dense, step.rows, step.cols
        self.length, self.mask = step.length, step.mask

    def update(self, k: torch.Tensor, v: torch.Tensor):
        # Advanced indexing around a slice puts the indexed dims first: [B, T, H, D].
        self.k[self.rows, :, self.cols] = k.transpose(1, 2)
        self.v[self.rows, :, self.cols] = v.transpose(1, 2)
        if self.dense:
            b = self.rows.size(0)
            return self.k[:b, :, : self.length], self.v[:b, :, : self.length], self.mask
        slots = self.rows[:, 0]
        # index_select on the sliced view copies only the live prefix (several times faster than fancy indexing).
        k = self.k[:, :, : self.length].index_select(0, slots)
        return k, self.v[:, :, : self.length].index_select(0, slots), self.mask


def positions_and_caches(idx: torch.Tensor, seq_len: int, n_layer: int, cache: KVCache | None,
                         slots: torch.Tensor | None, positions: torch.Tensor | None,
                         ) -> tuple[torch.Tensor, list[LayerCache | None]]:
    """A forward's token positions ([1, T] without a cache, [B, T] with one) and each layer's cache view.

    With `cache`, row b of `idx` continues the sequence in cache slot `slots[b]` from `positions[b]`.
    """
    t = idx.size(1)
    if cache is None:
        if t > seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={seq_len}")
        return torch.arange(t, device=idx.device)[None], [None] * n_layer
    assert slots is not None and positions is not None
    pos = positions[:, None] + torch.arange(t, device=idx.device)
    if int(pos.max()) >= min(seq_len, cache.max_len):
        raise ValueError("sequence longer than the model's context")
    dense = bool((slots == torch.arange(slots.numel(), device=slots.device)).all())
    step = Step(slots, positions, t, dense)
    return pos, [LayerCache(cache, i, step) for i in range(n_layer)]
