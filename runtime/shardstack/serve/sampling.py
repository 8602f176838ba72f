"""Next-token sampling for a batch of sequences with per-request temperature, top-p and random stream.

Every request owns a `torch.Generator`, so a seeded request draws the same random numbers whatever else
shares its batch. Sampling runs on CPU in float32 (the logits cross to the host anyway to be streamed), so a
seed gives the same choice on GPU and CPU hosts for the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    seed: int | None = None


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()  # non-deterministic, from the OS
    else:
        g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row of `logits` [B, V] (float32, CPU)."""
    greedy = logits.argmax(dim=-1)
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cum = sorted_probs.cumsum(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    # Keep the smallest prefix whose mass reaches top_p: a token is dropped if the mass before it already does.
    sorted_probs = sorted_probs.masked_fill(cum - sorted_probs >= top_p[:, None], 0.0)
    cum = sorted_probs.cumsum(dim=-1)
    # Inverse-CDF draw with one uniform per row from that row's own generator.
    u = torch.cat([torch.rand(1, generator=g, dtype=logits.dtype) for g in generators]) * cum[:, -1]
    pick = torch.searchsorted(cum, u[:, None]).clamp_(max=cum.size(1) - 1)
    # searchsorted can land on a zeroed tail entry only through rounding; step back to the last kept token.
    kept = (sorted_probs > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, kept)
    drawn = order.gather(1, pick).squeeze(1)
    is_greedy = torch.tensor([p.temperature == 0.0 for p in params])
    return torch.where(is_greedy, greedy, drawn).tolist()
