"""The Hugging Face convention for Llama, in one place: config.json ↔ LlamaConfig, tensor names ↔ ours, and the
checks a directory passes before anything reads its weights.

A directory is `config.json` (`LlamaForCausalLM`), the weights as `model.safetensors` or as several files listed by
`model.safetensors.index.json`, and optionally `generation_config.json` and the tokenizer files. Our Llama uses
transformers' parameter layout and RoPE convention, so the tensors map one to one by name, unpermuted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardstack.errors import ShardstackError
from shardstack.model.dtypes import dtype_name
from shardstack.model.shapes import LlamaConfig, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Older exports store RoPE's inverse frequencies; they are recomputed from the config, so the tensor is ignored.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# Our names ↔ transformers': top-level tensors, and those inside block i (`blocks.{i}.` ↔ `model.layers.{i}.`).
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
          **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}


def to_hf(name: str) -> str:
    """Our parameter name → transformers' (`blocks.3.attn.q_proj.weight` → `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if not m or m[2] not in _BLOCK:
        raise KeyError(f"{name} has no Hugging Face name")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}"


def from_hf(name: str) -> str:
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or m[2] not in _BLOCK_BACK:
        raise KeyError(f"{name} is not a Llama tensor")
    return f"blocks.{m[1]}.{_BLOCK_BACK[m[2]]}"


@dataclass
class HFConfig:
    model: LlamaConfig
    dtype: torch.dtype | None  # what config.json says the weights are stored as (torch_dtype / dtype), if it says
    raw: dict[str, Any]


def _unsupported(path: Path, what: str) -> ShardstackError:
    return ShardstackError(f"{path}: {what}", hint=f"shardstack loads the Llama architecture ({ARCHITECTURE}) as "
                           "transformers writes it")


def read_config(directory: str | Path, **overrides: Any) -> HFConfig:
    """The model a Hugging Face directory holds, from its config.json; `overrides` replace fields (e.g. seq_len)."""
    path = Path(directory) / CONFIG
    if not Path(directory).is_dir():
        raise ShardstackError(f"model.init_from: {directory} is not a directory",
                              hint="point it at a Hugging Face model directory (config.json + *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardstackError(f"{directory} has no {CONFIG}",
                              hint="a Hugging Face model directory holds config.json and *.safetensors") from None
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path} is unreadable: {exc}") from None
    archs = raw.get("architectures") or ([ARCHITECTURE] if raw.get("model_type") == "llama" else [])
    if ARCHITECTURE not in archs:
        found = ", ".join(archs) or f"model_type {raw.get('model_type')!r}"
        raise _unsupported(path, f"unsupported architecture {found}")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise _unsupported(path, f"{key} is {raw[key]!r}; only {want!r} is supported")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise ShardstackError(f"{path} lacks {', '.join(missing)}")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    if raw.get("head_dim") not in (None, hidden // heads):
        raise _unsupported(path, f"head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads")
    # transformers ≥ 5 writes rope_parameters (theta inside); earlier versions rope_theta and rope_scaling.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ("default", "llama3"):
        raise _unsupported(path, f"rope type {kind!r}; supported: default, llama3")
    scaling = None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        try:
            scaling = RopeScaling(**{k: rope[k] for k in keys})
        except KeyError as exc:
            raise ShardstackError(f"{path}: llama3 rope scaling lacks {exc.args[0]}") from None
    fields = {
        "vocab_size": raw["vocab_size"], "n_layer": raw["num_hidden_layers"], "n_head": heads,
        "n_kv_head": raw.get("num_key_value_heads") or heads, "d_model": hidden, "ffn_dim": raw["intermediate_size"],
        "seq_len": raw.get("max_position_embeddings", 2048), "norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta), "rope_scaling": scaling, "tie_embeddings": bool(raw.get("tie_word_embeddings")),
    }
    fields.update(overrides)
    try:
        model = LlamaConfig(**fields)
    except ValueError as exc:
        raise ShardstackError(f"{path}: {exc}") from None
    stored = raw.get("dtype") or raw.get("torch_dtype")
    if stored is not None and stored not in DTYPES:
        raise _unsupported(path, f"weights dtype {stored!r}; supported: {', '.join(DTYPES)}")
    return HFConfig(model=model, dtype=DTYPES[stored] if stored else None, raw=raw)


def config_json(model: LlamaConfig, dtype: torch.dtype, *, bos_token_id: int | None = None,
                eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json transformers reads for `model` (legacy rope keys: read by transformers 4 and 5 alike)."""
    rope = None
    if model.rope_scaling is not None:
        rope = {"rope_type": "llama3", **model.to_dict()["rope_scaling"]}
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": model.ffn_dim, "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head, "num_key_value_heads": model.n_kv_head, "head_dim": model.head_dim,
        "hidden_act": "silu", "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta, "rope_scaling": rope, "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype_name(dtype), "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def expected_tensors(model: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a directory for `model` holds: Hugging Face name → shape; a tied head is stored once, as the
    embedding. (Arithmetic rather than a meta-device Llama: building on meta imports torch._dynamo, ~30 MiB that the
    export's memory bound has no room for. A test keeps this equal to Llama's parameters.)"""
    d, kv, f = model.d_model, model.n_kv_head * model.head_dim, model.ffn_dim
    out = {"model.embed_tokens.weight": (model.vocab_size, d)}
    for i in range(model.n_layer):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d), p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f)}
    out["model.norm.weight"] = (d,)
    if not model.tie_embeddings:
        out["lm_head.weight"] = (model.vocab_size, d)
    return out


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name → the file that holds it, from the index or the single file; a consistent index is required."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ShardstackError(f"{index} is not a safetensors index ({exc})") from None
        files = {name: directory / file for name, file in weight_map.items()}
        for name, file in files.items():
            if not file.is_file():
                raise ShardstackError(f"{index} maps {name} to {file.name}, which does not exist")
        listed = {f.name for f in files.values()}
        stray = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in listed)
        if stray:  # the streaming reader reads every *.safetensors in the directory: an unlisted one would be mixed in
            raise ShardstackError(f"{directory}: {', '.join(stray)} not listed in {INDEX}",
                                  hint="remove the file or add it to the index")
        return files
    single = directory / SINGLE
    if not single.is_file():
        raise ShardstackError(f"{directory} has neither {SINGLE} nor {INDEX}",
                              hint="a Hugging Face model directory holds its weights as safetensors")
    others = sorted(p.name for p in directory.glob("*.safetensors") if p != single)
    if others:
        raise ShardstackError(f"{directory}: {', '.join(others)} beside {SINGLE} and no {INDEX}",
                              hint="the streaming reader reads every *.safetensors file: remove the stray ones")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def check_weights(directory: str | Path, hf: HFConfig) -> None:
    """Every tensor `hf.model` needs is present, where the index says, with the right shape and dtype (headers only:
    no tensor data is read). Raises ShardstackError naming the file and tensor otherwise."""
    from safetensors import SafetensorError, safe_open

    files = weight_files(directory)
    expected = expected_tensors(hf.model)
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ShardstackError(f"{directory}: tensor {missing[0]} is missing{more}",
                              hint="the weights do not match config.json")
    tied_head = "lm_head.weight" if hf.model.tie_embeddings else None
    unexpected = [n for n in files if n not in expected and n != tied_head and not _IGNORED.fullmatch(n)]
    if unexpected:
        raise ShardstackError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]} for the model config.json "
                              f"describes")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    dtype = None
    for file, names in by_file.items():
        try:
            with safe_open(str(file), "pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ShardstackError(f"{file.name} does not hold {name}, which the index maps to it")
                    sl = f.get_slice(name)
                    shape, code = tuple(sl.get_shape()), sl.get_dtype()
                    if shape != expected[name]:
                        raise ShardstackError(f"{file.name}: tensor {name} has shape {shape}; config.json implies "
                                              f"{expected[name]}")
                    got = _SAFETENSORS_DTYPES.get(code)
                    want = hf.dtype or dtype or got
                    if got is None or got != want:
                        wanted = dtype_name(want) if want else "a float dtype"
                        raise ShardstackError(f"{file.name}: tensor {name} is {code}; expected {wanted}"
                                              + (" (config.json's dtype)" if hf.dtype else ""))
                    dtype = got
        except SafetensorError as exc:
            raise ShardstackError(f"{file} is not a readable safetensors file ({exc})") from None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
