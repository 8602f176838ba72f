"""A GPT decoder in the spirit of nanoGPT: small enough to read, sized from a few MB to ~1.3B parameters.

The same module trains (full causal attention) and serves: with a `KVCache`, `forward` appends each row's new
keys/values into its own cache slot at its own position, so a batch can mix sequences of different lengths
(continuous batching). The shard unit for FSDP2 is one `Block` (`model.blocks`). Built on the meta device it holds
no memory; `init_param` is its initialisation, applied per shard by `shardstack.model.init`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardstack.model.init import init_parameters
from shardstack.model.kvcache import KVCache, LayerCache, positions_and_caches

BYTE_VOCAB = 256  # the default byte-level tokenizer: token id == byte value


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = BYTE_VOCAB
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def n_kv_head(self) -> int:  # the KV cache's heads: every head has its own keys and values here
        return self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes; `model.size` in a job config picks one, explicit fields override it.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64},
    "small": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024},
    "gpt-350m": {"n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": 1024},
    "gpt-1.3b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 2048},
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            k, v, mask = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise from `seed` (default: torch's, so `torch.manual_seed(s); GPT(c)` is the trainer's init with
        seed s). On the meta device this does nothing: the trainer fills the shards after sharding."""
        init_parameters(self, torch.initial_seed() if seed is None else seed)

    def init_param(self, name: str, rows: torch.Tensor, generator: torch.Generator) -> None:
        """GPT-2 init for rows of parameter `name`: normal(0.02), residual projections scaled by 1/sqrt(2·layers)."""
        if rows.dim() >= 2:
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 0.02
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
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block, layer_cache in zip(self.blocks, layer_caches, strict=True):
            x = block(x, layer_cache)
        if last is not None:  # a prefill samples from one position per row: skip the head's T·V elsewhere
            x = x[torch.arange(x.size(0), device=x.device), last][:, None]
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self, *, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B: 6·N + 12·L·d·T (N without position embeddings)."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.d_model * c.seq_len
