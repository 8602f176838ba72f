"""The decoder trunk GPT and Llama share: token embedding, `blocks`, final norm and (optionally tied) head; the
forward that trains (full causal attention) and serves (a `KVCache`: each row of a batch appends its new keys and
values into its own cache slot at its own position, so a batch mixes sequences of different lengths); the seeded
per-shard init; parameter and FLOPs counts. A subclass registers its modules (names and order are the checkpoints')
and says how it embeds and normalises.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shardstack.model.init import init_parameters
from shardstack.model.kvcache import KVCache, positions_and_caches
from shardstack.model.shapes import GPTConfig, LlamaConfig
from shardstack.model.spec import ARCHS, ArchSpec


class Decoder(nn.Module):
    arch: ClassVar[str]  # its ArchSpec in shardstack.model.spec.ARCHS
    # Matrices that write into the residual stream: their init std is scaled by 1/sqrt(2·layers) (GPT-2).
    residual_weights: ClassVar[tuple[str, ...]]
    config: GPTConfig | LlamaConfig
    tok_emb: nn.Embedding
    blocks: nn.ModuleList
    lm_head: nn.Linear

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    def _add_head(self) -> None:
        """The head, last (after the subclass's modules), tied to the embedding if configured; then the init."""
        self.lm_head = nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The blocks' input and the extra arguments every block takes before its cache (Llama: RoPE's cos, sin)."""
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lookup_params(self) -> int:
        """Parameters that are only looked up (no FLOPs): left out of the FLOPs count."""
        raise NotImplementedError

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise from `seed` (default: torch's, so `torch.manual_seed(s); GPT(c)` is the trainer's init with
        seed s). On the meta device this does nothing: the trainer fills the shards after sharding."""
        init_parameters(self, torch.initial_seed() if seed is None else seed)

    def init_param(self, name: str, rows: torch.Tensor, generator: torch.Generator) -> None:
        """normal(0.02) for matrices, the residual outputs scaled by 1/sqrt(2·layers); biases 0, norm weights 1."""
        if rows.dim() >= 2:
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith(self.residual_weights) else 0.02
            rows.normal_(0.0, std, generator=generator)
        elif name.endswith("bias"):
            rows.zero_()
        else:
            rows.fill_(1.0)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V], or the mean cross-entropy when `targets` is given.

        With `cache`, row b of `idx` continues the sequence in cache slot `slots[b]` from `positions[b]`. With
        `last` ([B] indices into T), only row b's hidden state at `last[b]` reaches the head: logits [B, 1, V].
        """
        pos, layer_caches = positions_and_caches(idx, self.config.seq_len, len(self.blocks), cache, slots, positions)
        x, extra = self.embed(idx, pos)
        for block, layer_cache in zip(self.blocks, layer_caches, strict=True):
            x = block(x, *extra, layer_cache)
        if last is not None:  # a prefill samples from one position per row: skip the head's T·V elsewhere
            x = x[torch.arange(x.size(0), device=x.device), last][:, None]
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self, *, non_embedding: bool = False) -> int:
        """All parameters (a tied head once); `non_embedding` leaves out those only looked up."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.lookup_params() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B: 6·N + 12·L·d·T, N without lookup-only parameters. The
        attention term uses the query width (n_head · head_dim = d): grouped-query attention shrinks K/V, not QKᵀ
        or AV."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.d_model * c.seq_len


def arch_spec(model: nn.Module) -> ArchSpec | None:
    """The built-in architecture `model` is, or None for a `model.factory` model."""
    return model.spec if isinstance(model, Decoder) else None


def flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: the decoder's count, or 6·N for a `model.factory` model."""
    if isinstance(model, Decoder):
        return model.flops_per_token()
    return 6 * sum(p.numel() for p in model.parameters())
