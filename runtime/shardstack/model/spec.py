"""The model contract and the registry of built-in architectures, without torch: a job's `model:` section is read,
checked and hashed on the controller, which has no torch; the modules are built (torch imported) on the nodes.

- `ShardedModel`: what the trainer needs of any model, built-in or `model.factory` (checked once, in build_model).
- `ArchSpec`: one built-in architecture — its shape, the job config's typed overrides, named sizes, its module
  (imported on first build), its tensor-parallel plan and whether it has Hugging Face interop.
- `ModelConfig`: the `model:` section, `{arch, size, overrides}` (overrides typed per arch) or init_from / factory.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from shardstack.errors import ShardstackError
from shardstack.model.shapes import GPT_PRESETS, LLAMA_PRESETS, GPTConfig, LlamaConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


class ModelShape(Protocol):
    """The shape fields every model's `config` has (the data windows, the vocabulary check, the estimator)."""

    vocab_size: int
    n_layer: int
    d_model: int
    seq_len: int


@runtime_checkable
class ShardedModel(Protocol):
    """Any model the trainer runs: `forward(idx, targets)` returns the mean loss; `blocks` are its layers (one FSDP
    unit, activation-checkpointing and compile unit each); `init_param` is its initialisation, applied per shard on
    the meta device (shardstack.model.init); `config` gives its shape."""

    config: ModelShape
    blocks: nn.ModuleList

    def init_param(self, name: str, rows: torch.Tensor, generator: torch.Generator) -> None: ...

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor: ...


# The overrides a job may give per architecture: the section's fields beside arch/size, all optional (unset: the
# preset's value). Field names are the shape's.
@dataclass
class SharedFields:
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None


@dataclass
class GPTFields(SharedFields):
    mlp_ratio: int | None = None
    dropout: float | None = None
    bias: bool | None = None


@dataclass
class LlamaFields(SharedFields):
    n_kv_head: int | None = None
    ffn_dim: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, float] | None = None  # Llama 3.1's: factor, low_freq_factor, high_freq_factor, original_…


@dataclass(frozen=True)
class ArchSpec:
    name: str
    shape: type[GPTConfig] | type[LlamaConfig]
    fields: type[GPTFields] | type[LlamaFields]
    presets: Mapping[str, Mapping[str, Any]]
    module: str  # "package.module:Class", imported on first build: torch stays on the nodes
    # Block submodule → "colwise" | "rowwise" (Megatron's split, shardstack.train.parallelize); None: no tensor
    # parallelism (the GPT's fused qkv cannot be split by heads).
    tp_plan: Mapping[str, str] | None = None
    hf: bool = False  # model.init_from and `export --format hf` (the name map and config.json: model/hf.py)

    def model_class(self) -> type[nn.Module]:
        mod, _, cls = self.module.partition(":")
        return getattr(importlib.import_module(mod), cls)

    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.fields))


ARCHS: dict[str, ArchSpec] = {
    "gpt": ArchSpec("gpt", GPTConfig, GPTFields, GPT_PRESETS, "shardstack.model.gpt:GPT"),
    "llama": ArchSpec(
        "llama", LlamaConfig, LlamaFields, LLAMA_PRESETS, "shardstack.model.llama:Llama", hf=True,
        # Column-sharded projections give each rank whole heads and a slice of the SwiGLU width; the row-sharded
        # o_proj and down_proj sum the partial outputs (one all-reduce each): between blocks all stays replicated.
        tp_plan={"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                 "attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}),
}
DEFAULT_SIZE = "small"
# The section's keys beside the overrides (the YAML is flat: `model: {arch: llama, size: tiny, n_kv_head: 1}`).
SECTION_KEYS = ("arch", "size", "init_from", "factory", "factory_kwargs")
# What a job may still choose for a model whose shape comes from init_from's config.json.
_INIT_FROM_OVERRIDES = ("seq_len",)


@dataclass
class ModelConfig:
    arch: Literal["gpt", "llama"] | None = None  # default gpt, or what init_from's config.json says
    size: str | None = None  # a preset of the arch (default "small"); the overrides replace its fields
    overrides: GPTFields | LlamaFields | None = None  # None: the arch's, all unset
    # A Hugging Face model directory (config.json + safetensors): its architecture, shape and weights.
    init_from: str | None = None
    # A user model instead of the built-in ones: "package.module:factory", called as factory(**factory_kwargs),
    # returning a ShardedModel (docs/runtime.md).
    factory: str | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.overrides is None:
            self.overrides = ARCHS[model_arch(self)].fields()

    @classmethod
    def of(cls, **flat: Any) -> ModelConfig:
        """From the section's flat keys, as a job config writes them (values already of the right type)."""
        top = {k: flat.pop(k) for k in SECTION_KEYS if k in flat}
        cfg = cls(**top)
        spec = ARCHS[model_arch(cfg)]
        check_arch_keys(spec, flat)
        unknown = set(flat) - set(spec.field_names())
        if unknown:
            raise ShardstackError(f"unknown config key 'model.{sorted(unknown)[0]}'")
        cfg.overrides = spec.fields(**flat)
        return cfg

    def explicit(self) -> dict[str, Any]:
        """The overrides the job sets."""
        return {k: v for k, v in dataclasses.asdict(self.overrides).items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """The flat section as a job config writes it, every known key present (unset: None): the config hash and
        the checkpoints' recorded job config have had this shape since before the overrides were typed per arch."""
        out: dict[str, Any] = {k: getattr(self, k) for k in SECTION_KEYS}
        out["factory_kwargs"] = dict(self.factory_kwargs)
        out |= {name: None for spec in ARCHS.values() for name in spec.field_names()}
        return out | dataclasses.asdict(self.overrides)


def check_arch_keys(spec: ArchSpec, keys: Mapping[str, Any]) -> None:
    """Refuse a set field that belongs to another architecture (naming it), before any unknown-key check."""
    own = spec.field_names()
    for key, value in keys.items():
        owner = next((s.name for s in ARCHS.values() if key in s.field_names()), None)
        if value is not None and key not in own and owner:
            raise ShardstackError(f"config key 'model.{key}' applies to arch {owner}, not {spec.name}")


def model_arch(cfg: ModelConfig) -> str:
    """The built-in architecture `cfg` names (an init_from directory holds a Llama: hf.read_config checks it)."""
    return cfg.arch or ("llama" if cfg.init_from is not None else "gpt")


def check_model_config(cfg: ModelConfig) -> None:
    """Static checks of the section (no file is read: a cluster's init_from path need not exist here)."""
    if cfg.factory is not None:
        if ":" not in cfg.factory:
            raise ShardstackError(
                f"config key 'model.factory' is {cfg.factory!r}; expected 'package.module:function'")
        return
    spec = ARCHS[model_arch(cfg)]
    if type(cfg.overrides) is not spec.fields:
        check_arch_keys(spec, cfg.explicit())
        raise ShardstackError(f"model overrides are {type(cfg.overrides).__name__}, not arch {spec.name}'s")
    if cfg.init_from is not None:
        if not spec.hf:
            raise ShardstackError(f"config key 'model.init_from' loads a Hugging Face Llama, but model.arch is "
                                  f"{spec.name}", hint="leave model.arch unset (config.json names the architecture)")
        fixed = {k: v for k, v in {"size": cfg.size, **cfg.explicit()}.items()
                 if v is not None and k not in _INIT_FROM_OVERRIDES}
        if fixed:
            key = next(iter(fixed))
            raise ShardstackError(f"config key 'model.{key}' conflicts with model.init_from: the shape comes from its "
                                  "config.json", hint=f"only {', '.join(_INIT_FROM_OVERRIDES)} may be set beside it")
        return
    if cfg.size is not None and cfg.size not in spec.presets:
        close = difflib.get_close_matches(cfg.size, list(spec.presets), n=1)
        raise ShardstackError(
            f"config key 'model.size' is {cfg.size!r}; expected one of {', '.join(spec.presets)} (arch {spec.name})",
            hint=f"did you mean '{close[0]}'?" if close else None,
        )


def arch_config(cfg: ModelConfig) -> GPTConfig | LlamaConfig:
    """The built-in architecture's shape for `cfg`: init_from's config.json (read here), or the preset with the
    overrides applied. Raises ShardstackError for bad values."""
    if cfg.factory:
        raise ShardstackError(f"model.factory {cfg.factory!r} is a user model, not a built-in architecture")
    check_model_config(cfg)
    if cfg.init_from is not None:
        from shardstack.model.hf import read_config

        return read_config(cfg.init_from, **cfg.explicit()).model
    spec = ARCHS[model_arch(cfg)]
    try:
        return spec.shape(**{**spec.presets[cfg.size or DEFAULT_SIZE], **cfg.explicit()})
    except ValueError as exc:
        raise ShardstackError(f"config section 'model': {exc}") from None


def build_arch(arch: str, fields: Mapping[str, Any]) -> nn.Module:
    """A built-in architecture from its shape's fields (what exports record), on the current default device."""
    spec = ARCHS[arch]
    return spec.model_class()(spec.shape(**fields))


def build_model(cfg: ModelConfig) -> ShardedModel:
    """The module `cfg` describes, on the current default device (callers pick it with `with torch.device(...)`;
    the trainer builds on "meta" and materialises only each rank's shards)."""
    if not cfg.factory:
        return ARCHS[model_arch(cfg)].model_class()(arch_config(cfg))
    mod_name, _, fn_name = cfg.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ShardstackError(f"config key 'model.factory': cannot load {cfg.factory!r} ({exc})") from None
    model = factory(**cfg.factory_kwargs)
    check_model(model, f"model.factory {cfg.factory!r}")
    return model


def check_model(model: object, what: str) -> None:
    """Refuse a model that does not keep the ShardedModel contract, naming what it lacks."""
    from torch import nn

    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise ShardstackError(f"{what} returned {name}, not an nn.Module")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not blocks:
        raise ShardstackError(f"{name} has no `blocks` (a non-empty ModuleList of its layers)",
                              hint="FSDP shards one block per unit; expose the transformer layers as `model.blocks`")
    if not callable(getattr(model, "init_param", None)):
        raise ShardstackError(
            f"{name} cannot be initialised on the meta device: it has no init_param(name, rows, generator)",
            hint="the trainer builds models on the meta device and fills only each rank's shards; add the hook "
                 "(docs/runtime.md, 'Your own model') or load weights with model.init_from")
    shape = getattr(model, "config", None)
    missing = [f for f in ModelShape.__annotations__ if not isinstance(getattr(shape, f, None), int)]
    if missing:
        raise ShardstackError(f"{name} has no config.{missing[0]}: the trainer needs its config's "
                              f"{', '.join(ModelShape.__annotations__)}")
