"""The model runner: the model and its KV cache on one device, and the two forward passes the scheduler needs.

`prefill` right-pads prompt pieces (whole prompts, or a chunk of a long one continuing at its own position) to a
common length and writes them into their cache slots (the padding writes entries past each piece's end, which
that row's mask hides and its own later steps overwrite); `decode` runs one token for each running request at its
own position. Both return the logits of each row's last real position, [B, V]: prefill applies the LM head to
that one position only, not to all T.
"""

from __future__ import annotations

import torch

from shardstack.model.decoder import Decoder
from shardstack.model.kvcache import KVCache
from shardstack.serve.memory import check_kv_cache

Model = Decoder  # what exports hold (GPT, Llama): each row decodes in its own KV-cache slot


class ModelRunner:
    def __init__(self, model: Model, *, slots: int, context: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.model = model
        self.device = torch.device(device)
        # Sized by the model's config: n_kv_head key/value heads per layer (fewer than n_head under GQA), and
        # checked against what the device has left before it is allocated.
        check_kv_cache(model.config, slots, context, dtype, self.device)
        self.cache = KVCache(model.config, slots, context, dtype=dtype, device=self.device)

    def kv_cache_bytes(self) -> int:
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def prefill(self, prompts: list[list[int]], slots: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """Write each row's tokens into its slot from `starts[row]` (default 0) and return the logits of each row's
        last token, [B, V]. Rows that start at different positions must not be padded past the context: the
        scheduler only batches rows that start at 0."""
        longest = max(len(p) for p in prompts)
        idx = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            idx[row, : len(prompt)] = torch.tensor(prompt)
        logits = self.model(
            idx.to(self.device),
            cache=self.cache,
            slots=torch.tensor(slots, device=self.device),
            positions=torch.tensor(starts or [0] * len(prompts), dtype=torch.long, device=self.device),
            last=torch.tensor([len(p) - 1 for p in prompts], device=self.device),
        )
        return logits[:, 0]

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        logits = self.model(
            torch.tensor([[t] for t in tokens], device=self.device),
            cache=self.cache,
            slots=torch.tensor(slots, device=self.device),
            positions=torch.tensor(positions, device=self.device),
        )
        return logits[:, -1]
