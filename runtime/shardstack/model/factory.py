"""What a job's `model:` section says, and the module built from it — the one place that maps one to the other:
a built-in architecture (`arch: gpt | llama`) from a preset plus overrides, a Hugging Face directory
(`init_from: DIR`: its config.json gives the shape, overridable fields such as seq_len apply), or the user's
`package.module:factory`.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from shardstack.errors import ShardstackError
from shardstack.model import gpt, llama

# arch → (module class, config class, presets)
ARCHS: dict[str, tuple[type[nn.Module], type, dict[str, dict]]] = {
    "gpt": (gpt.GPT, gpt.GPTConfig, gpt.PRESETS),
    "llama": (llama.Llama, llama.LlamaConfig, llama.PRESETS),
}
DEFAULT_SIZE = "small"
_SHARED = ("n_layer", "n_head", "d_model", "seq_len", "vocab_size", "tie_embeddings")
_ONLY: dict[str, tuple[str, ...]] = {
    "gpt": ("mlp_ratio", "dropout", "bias"),
    "llama": ("n_kv_head", "ffn_dim", "norm_eps", "rope_theta", "rope_scaling"),
}
# What a job may still choose for a model whose shape comes from init_from's config.json.
_INIT_FROM_OVERRIDES = ("seq_len",)


@dataclass
class ModelConfig:
    arch: Literal["gpt", "llama"] | None = None  # default gpt, or what init_from's config.json says
    size: str | None = None  # a preset of the arch (default "small"); the fields below override it
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    # gpt only
    mlp_ratio: int | None = None
    dropout: float | None = None
    bias: bool | None = None
    # llama only
    n_kv_head: int | None = None
    ffn_dim: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, float] | None = None  # Llama 3.1's: factor, low_freq_factor, high_freq_factor, original_…
    # A Hugging Face model directory (config.json + safetensors): its architecture, shape and weights.
    init_from: str | None = None
    # A user model instead of the built-in ones: "package.module:factory", called as factory(**factory_kwargs).
    # It must return an nn.Module whose forward(idx, targets) returns the mean loss, with `blocks` (its shard units)
    # and init_param(name, rows, generator) (its initialisation; docs/runtime.md).
    factory: str | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)


def _explicit(cfg: ModelConfig, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(cfg, n) for n in names if getattr(cfg, n) is not None}


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
    arch = model_arch(cfg)
    other = next(a for a in ARCHS if a != arch)
    wrong = _explicit(cfg, tuple(n for n in _ONLY[other] if n not in _ONLY[arch]))
    if wrong:
        key = next(iter(wrong))
        raise ShardstackError(f"config key 'model.{key}' applies to arch {other}, not {arch}")
    if cfg.init_from is not None:
        if arch != "llama":
            raise ShardstackError("config key 'model.init_from' loads a Hugging Face Llama, but model.arch is gpt",
                                  hint="leave model.arch unset (config.json names the architecture)")
        fixed = _explicit(cfg, ("size", *(n for n in (*_SHARED, *_ONLY[arch]) if n not in _INIT_FROM_OVERRIDES)))
        if fixed:
            key = next(iter(fixed))
            raise ShardstackError(f"config key 'model.{key}' conflicts with model.init_from: the shape comes from its "
                                  "config.json", hint=f"only {', '.join(_INIT_FROM_OVERRIDES)} may be set beside it")
        return
    presets = ARCHS[arch][2]
    if cfg.size is not None and cfg.size not in presets:
        close = difflib.get_close_matches(cfg.size, list(presets), n=1)
        raise ShardstackError(
            f"config key 'model.size' is {cfg.size!r}; expected one of {', '.join(presets)} (arch {arch})",
            hint=f"did you mean '{close[0]}'?" if close else None,
        )


def arch_config(cfg: ModelConfig) -> gpt.GPTConfig | llama.LlamaConfig:
    """The built-in architecture's config for `cfg`: init_from's config.json, or the preset with the explicit
    overrides applied. Raises ShardstackError for bad values."""
    if cfg.factory:
        raise ShardstackError(f"model.factory {cfg.factory!r} is a user model, not a built-in architecture")
    check_model_config(cfg)
    if cfg.init_from is not None:
        from shardstack.model.hf import read_config

        return read_config(cfg.init_from, **_explicit(cfg, _INIT_FROM_OVERRIDES)).model
    arch = model_arch(cfg)
    _cls, config_cls, presets = ARCHS[arch]
    fields = {**presets[cfg.size or DEFAULT_SIZE], **_explicit(cfg, (*_SHARED, *_ONLY[arch]))}
    try:
        return config_cls(**fields)
    except ValueError as exc:
        raise ShardstackError(f"config section 'model': {exc}") from None


def build_arch(arch: str, fields: dict[str, Any]) -> nn.Module:
    """A built-in architecture from its config fields (what exports record), on the current default device."""
    model_cls, config_cls, _ = ARCHS[arch]
    return model_cls(config_cls(**fields))


def build_model(cfg: ModelConfig) -> nn.Module:
    """The module `cfg` describes, on the current default device (callers pick it with `with torch.device(...)`;
    the trainer builds on "meta" and materialises only each rank's shards)."""
    if cfg.factory:
        mod_name, _, fn_name = cfg.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ShardstackError(f"config key 'model.factory': cannot load {cfg.factory!r} ({exc})") from None
        model = factory(**cfg.factory_kwargs)
        if not isinstance(model, nn.Module):
            raise ShardstackError(f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
        return model
    config = arch_config(cfg)
    return ARCHS[model_arch(cfg)][0](config)
