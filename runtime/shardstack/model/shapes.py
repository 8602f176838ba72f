"""The built-in architectures' shapes and named sizes, without torch: the job config, the controller and the
Hugging Face config reader need them, the modules (`gpt`, `llama`) are built from them on the nodes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

BYTE_VOCAB = 256  # the default byte-level tokenizer: token id == byte value
LLAMA3_VOCAB = 128256


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


# Named sizes; `model.size` in a job config picks one, explicit fields override it.
GPT_PRESETS: dict[str, dict] = {
    "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64},
    "small": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024},
    "gpt-350m": {"n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": 1024},
    "gpt-1.3b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 2048},
}

_LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": RopeScaling()}
# The llama3 shapes are those of the published Llama 3.1 / 3.2 models (seq_len is the training window, not the 128k
# the weights extrapolate to).
LLAMA_PRESETS: dict[str, dict] = {
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
