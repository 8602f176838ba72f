"""Next-token sampling for a batch of sequences with per-request temperature, top-p and random stream.

Every request owns a `torch.Generator`, so a seeded request draws the same random numbers whatever else
shares its batch. Sampling runs on CPU in float32 (the logits cross to the host anyway to be streamed), so a
seed gives the same choice on GPU and CPU hosts for the same logits. Rows never affect each other: a row that
cannot be sampled comes back as None for the caller to fail alone, instead of an exception that takes the
whole batch down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The smallest normal float32. A positive temperature or top_p below it is subnormal or 0 in float32 (and
# flushed to 0 where denormals are disabled), so the request schema refuses it rather than sample with 0.
FLOAT32_TINY = torch.finfo(torch.float32).tiny


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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int | None]:
    """One token per row of `logits` [B, V] (float32, CPU), or None for a row with no token to give: NaN or
    +inf logits, or parameters that leave no probability mass (top_p <= 0, a NaN or negative temperature)."""
    top = logits.amax(dim=-1, keepdim=True)
    usable = torch.isfinite(top[:, 0]) & ~logits.isnan().any(dim=-1)
    greedy = logits.argmax(dim=-1)
    is_greedy = torch.tensor([p.temperature == 0.0 for p in params])
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).masked_fill(is_greedy, 1.0)
    # Shifted by the row's maximum first: (x - max) / t is <= 0, so no temperature, however small, overflows.
    probs = torch.softmax((logits - top) / temps[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cum = sorted_probs.cumsum(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    # Keep the smallest prefix whose mass reaches top_p: a token is dropped if the mass before it already does.
    sorted_probs = sorted_probs.masked_fill(cum - sorted_probs >= top_p[:, None], 0.0)
    cum = sorted_probs.cumsum(dim=-1)
    mass = cum[:, -1]
    usable &= is_greedy | (torch.isfinite(mass) & (mass > 0))
    # Inverse-CDF draw with one uniform per row from that row's own generator (greedy rows draw too, so a
    # request's stream does not depend on its neighbours' settings).
    u = torch.cat([torch.rand(1, generator=g, dtype=logits.dtype) for g in generators]) * mass
    pick = torch.searchsorted(cum, u[:, None]).clamp_(max=cum.size(1) - 1)
    # searchsorted can land on a zeroed tail entry only through rounding; step back to the last kept token
    # (clamped at 0 so a row with nothing kept indexes safely and is reported through `usable`).
    kept = ((sorted_probs > 0).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    pick = torch.minimum(pick, kept)
    drawn = order.gather(1, pick).squeeze(1)
    tokens = torch.where(is_greedy, greedy, drawn).tolist()
    return [t if ok else None for t, ok in zip(tokens, usable.tolist(), strict=True)]
