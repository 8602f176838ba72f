"""The model runner: the model and its KV cache on one device, and the two forward passes the scheduler needs.

`prefill` right-pads the prompts of newly admitted requests to a common length and writes them into their cache
slots (the padding writes entries past each prompt's end, which that row's mask hides and its own decode steps
later overwrite); `decode` runs one token for each running request at its own position. Both return the logits
of each row's last real position, [B, V].
"""

from __future__ import annotations

import torch

from shardstack.model.gpt import GPT
from shardstack.model.kvcache import KVCache
from shardstack.model.llama import Llama

Model = GPT | Llama  # what exports hold; both decode each row in its own KV-cache slot


class ModelRunner:
    def __init__(self, model: Model, *, slots: int, context: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.model = model
        self.device = torch.device(device)
        # Sized by the model's config: n_kv_head key/value heads per layer (fewer than n_head under GQA).
        self.cache = KVCache(model.config, slots, context, dtype=dtype, device=self.device)

    def kv_cache_bytes(self) -> int:
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        longest = max(len(p) for p in prompts)
        idx = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            idx[row, : len(prompt)] = torch.tensor(prompt)
        logits = self.model(
            idx.to(self.device),
            cache=self.cache,
            slots=torch.tensor(slots, device=self.device),
            positions=torch.zeros(len(prompts), dtype=torch.long, device=self.device),
        )
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        return logits[torch.arange(len(prompts), device=self.device), last]

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        logits = self.model(
            torch.tensor([[t] for t in tokens], device=self.device),
            cache=self.cache,
            slots=torch.tensor(slots, device=self.device),
            positions=torch.tensor(positions, device=self.device),
        )
        return logits[:, -1]
