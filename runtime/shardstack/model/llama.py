"""The Llama family (Llama 2/3 shapes): RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention.

Parameters and RoPE follow Hugging Face transformers' `LlamaForCausalLM`: separate q/k/v/o and gate/up/down
projections, and q/k in the "rotate_half" layout (the two halves of a head are the two coordinates of each rotated
pair), so its safetensors load without a permutation (the name map is `shardstack.model.hf`). RoPE's cos/sin come
from the positions in every forward instead of buffers: a model built on the meta device then has nothing to restore
but its parameters. Like the GPT, the same module trains and serves: with a `KVCache` (sized by n_kv_head) each row
of a batch continues its own sequence in its own slot. The FSDP2 shard unit is one `Block` (`model.blocks`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shardstack.model.init import init_parameters
from shardstack.model.kvcache import KVCache, LayerCache, positions_and_caches

LLAMA3_VOCAB = 128256


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE scaling (`"rope_type": "llama3"` in a Hugging Face config): long wavelengths are stretched by
    `factor`, short ones kept, and the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        # YAML and JSON give numbers; the pretraining context is a token count.
        object.__setattr__(self, "original_max_position_embeddings", int(self.original_max_position_embeddings))


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # grouped-query attention: n_head / n_kv_head query heads share one key/value head
    d_model: int = 128
    ffn_dim: int = 384  # SwiGLU hidden size (Hugging Face: intermediate_size)
    seq_len: int = 256  # the training window and the serving context
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if isinstance(self.rope_scaling, dict):  # from YAML or JSON
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError:
                allowed = ", ".join(f.name for f in fields(RopeScaling))
                raise ValueError(f"rope_scaling takes {allowed}; got {sorted(self.rope_scaling)}") from None
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (d_model / n_head = {self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


_LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": RopeScaling()}
# Named sizes for `model: {arch: llama, size: …}`; explicit fields override them. The llama3 shapes are those of the
# published Llama 3.1 / 3.2 models (seq_len is the training window, not the 128k the weights extrapolate to).
PRESETS: dict[str, dict] = {
    "tiny": {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "ffn_dim": 192, "seq_len": 64},
    "small": {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 128, "ffn_dim": 384, "seq_len": 256},
    "llama3-1b": {"n_layer": 16, "n_head": 32, "n_kv_head": 8, "d_model": 2048, "ffn_dim": 8192, "seq_len": 8192,
                  "vocab_size": LLAMA3_VOCAB, "tie_embeddings": True,
                  **_LLAMA31_ROPE, "rope_scaling": RopeScaling(factor=32.0)},
    "llama3-8b": {"n_layer": 32, "n_head": 32, "n_kv_head": 8, "d_model": 4096, "ffn_dim": 14336, "seq_len": 8192,
                  "vocab_size": LLAMA3_VOCAB, **_LLAMA31_ROPE},
    "llama3-70b": {"n_layer": 80, "n_head": 64, "n_kv_head": 8, "d_model": 8192, "ffn_dim": 28672, "seq_len": 8192,
                   "vocab_size": LLAMA3_VOCAB, **_LLAMA31_ROPE},
    "llama3-405b": {"n_layer": 126, "n_head": 128, "n_kv_head": 8, "d_model": 16384, "ffn_dim": 53248,
                    "seq_len": 8192, "vocab_size": LLAMA3_VOCAB, **_LLAMA31_ROPE},
}


def rope_frequencies(config: LlamaConfig, device: torch.device) -> torch.Tensor:
    """The inverse frequencies [head_dim / 2] in fp32, computed exactly as transformers does (parity)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the projections' outputs: under tensor parallelism a rank holds n_head / K query
        # and n_kv_head / K key/value heads (whole heads, each GQA group with its key/value head).
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        gqa = self.n_kv_head != self.n_head  # SDPA shares each key/value head among its group of query heads
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            k, v, mask = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    # Tensor parallelism (shardstack.train.parallelize): Megatron's split. The column-sharded projections give each
    # rank whole heads and a slice of the SwiGLU width; the row-sharded o_proj and down_proj sum the partial
    # outputs (one all-reduce each), so everything between blocks stays replicated.
    TP_PLAN: ClassVar[dict[str, str]] = {
        "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise from `seed` (default: torch's); a no-op on the meta device (see shardstack.model.init)."""
        init_parameters(self, torch.initial_seed() if seed is None else seed)

    def init_param(self, name: str, rows: torch.Tensor, generator: torch.Generator) -> None:
        """normal(0.02) for matrices, the residual outputs (o_proj, down_proj) scaled by 1/sqrt(2·layers); norms 1."""
        if rows.dim() >= 2:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            rows.normal_(0.0, std, generator=generator)
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
        x = self.tok_emb(idx)
        # [B or 1, 1, T, head_dim]: both halves of a head rotate by the same angles (the rotate_half layout).
        freqs = pos[..., None].float() * rope_frequencies(self.config, idx.device)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block, layer_cache in zip(self.blocks, layer_caches, strict=True):
            x = block(x, cos, sin, layer_cache)
        if last is not None:  # a prefill samples from one position per row: skip the head's T·V elsewhere
            x = x[torch.arange(x.size(0), device=x.device), last][:, None]
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self, *, non_embedding: bool = False) -> int:
        """All parameters (a tied head once); `non_embedding` leaves out the input embedding, a lookup without FLOPs
        (unless tied: then the same matrix is the head's matmul)."""
        n = sum(p.numel() for p in self.parameters())
        untied = not self.config.tie_embeddings
        return n - self.tok_emb.weight.numel() if non_embedding and untied else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B: 6·N + 12·L·d·T, N without the input embedding. The attention
        term uses the query width (n_head · head_dim = d): grouped-query attention shrinks K/V, not QKᵀ or AV."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.d_model * c.seq_len
