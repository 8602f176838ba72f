"""The Llama family (Llama 2/3 shapes): RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention.

Parameters and RoPE follow Hugging Face transformers' `LlamaForCausalLM`: separate q/k/v/o and gate/up/down
projections, and q/k in the "rotate_half" layout (the two halves of a head are the two coordinates of each rotated
pair), so its safetensors load without a permutation (the name map is `shardstack.model.hf`). RoPE's cos/sin come
from the positions in every forward instead of buffers: a model built on the meta device then has nothing to restore
but its parameters. The trunk (forward with or without a KV cache, sized by n_kv_head; init; counts) is
`shardstack.model.decoder.Decoder`; the shape and presets are `shardstack.model.shapes`, the tensor-parallel plan
`shardstack.model.spec`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardstack.model.decoder import Decoder
from shardstack.model.kvcache import LayerCache
from shardstack.model.shapes import LlamaConfig


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


class Llama(Decoder):
    arch = "llama"
    residual_weights = ("o_proj.weight", "down_proj.weight")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self._add_head()

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x = self.tok_emb(idx)
        # [B or 1, 1, T, head_dim]: both halves of a head rotate by the same angles (the rotate_half layout).
        freqs = pos[..., None].float() * rope_frequencies(self.config, idx.device)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return x, (angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def lookup_params(self) -> int:
        """The input embedding, unless tied: then the same matrix is the head's matmul."""
        return 0 if self.config.tie_embeddings else self.tok_emb.weight.numel()
