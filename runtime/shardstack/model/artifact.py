"""The exported-model format: what `shardstack export` writes and `shardstack serve` loads, with one owner here.

    DIR/model.safetensors   keys exactly as GPT.state_dict() of an unwrapped model; a tied lm_head.weight is
                            stored once, as tok_emb.weight
    DIR/config.json         {"model": GPTConfig fields, "step", "dtype", "source_checkpoint", "tokenizer": "bytes"}

`write` streams: the safetensors header is computed up front from the names and shapes, then each tensor is
fetched by the caller's `read` and written in turn, so host memory holds about one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardstack.errors import ShardstackError
from shardstack.model.dtypes import SAFETENSORS, dtype_name
from shardstack.model.gpt import GPT, GPTConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TIED_HEAD = "lm_head.weight"  # stored once, as tok_emb.weight, when embeddings are tied


@dataclass
class WriteStats:
    bytes_written: int
    largest_tensor_bytes: int  # the largest tensor as `read` returned it (before the cast to the export dtype)


def stored_names(names: list[str], model_fields: dict[str, Any]) -> list[str]:
    """The state-dict keys the artifact stores: a tied head is left out (load_model re-ties it)."""
    tied = model_fields.get("tie_embeddings", True)
    return sorted(n for n in names if not (tied and n == TIED_HEAD))


def _header(entries: list[tuple[str, torch.Size]], dtype: torch.dtype, meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    width = torch.empty((), dtype=dtype).element_size()
    for name, shape in entries:
        nbytes = width * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces so tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write(out: str | os.PathLike, entries: list[tuple[str, torch.Size]], read: Callable[[str], torch.Tensor], *,
          dtype: torch.dtype, config: dict[str, Any], header_meta: dict[str, str]) -> WriteStats:
    """Write OUT/model.safetensors (tensors in `entries` order, each from `read(name)`, cast to `dtype`) and
    OUT/config.json. The weights file appears under its name only once complete and fsynced."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    written = largest = 0
    with open(tmp, "wb") as f:
        f.write(_header(entries, dtype, {"format": "pt", **header_meta}))
        for name, shape in entries:
            tensor = read(name)
            if tuple(tensor.shape) != tuple(shape):
                raise ShardstackError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
            largest = max(largest, tensor.numel() * tensor.element_size())
            data = tensor.to(dtype).contiguous()
            del tensor
            f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            written += data.numel() * data.element_size()
            del data
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return WriteStats(written, largest)


def save_model(model: GPT, out: str | os.PathLike, *, step: int, source: str,
               dtype: torch.dtype = torch.float32) -> Path:
    """An in-memory GPT as an artifact (tests, benchmarks, and trying the service before a training run)."""
    fields = model.config.to_dict()
    state = model.state_dict()
    names = stored_names(list(state), fields)
    config = {"model": fields, "step": step, "dtype": dtype_name(dtype), "source_checkpoint": source,
              "tokenizer": "bytes"}
    write(out, [(n, state[n].shape) for n in names], lambda n: state[n].detach(), dtype=dtype, config=config,
          header_meta={"step": str(step), "source_checkpoint": source})
    return Path(out)


def check_model_dir(path: Path) -> None:
    """Fail with a clear message unless `path` looks like an artifact (before anything heavy is imported)."""
    if not path.is_dir():
        raise ShardstackError(f"model directory {path} does not exist",
                              hint="point --model at the output of `shardstack export`")
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise ShardstackError(f"{path} has no {name}", hint="point --model at the output of `shardstack export`")
    try:
        json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path / CONFIG} is unreadable: {exc}") from None


def load_model(model_dir: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[GPT, dict[str, Any]]:
    """The exported GPT (eval mode, on `device` in `dtype`) and its config.json; raises ShardstackError if broken."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    try:
        meta = json.loads((model_dir / CONFIG).read_text())
        gpt_config = GPTConfig(**meta["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShardstackError(f"{model_dir}/{CONFIG} is not an export config: {exc}",
                              hint="point at the output of `shardstack export`") from exc
    with torch.device("meta"):
        model = GPT(gpt_config)
    state = load_file(str(model_dir / WEIGHTS), device=str(device))
    # assign=True adopts the loaded tensors (no second copy); the tied head is re-tied below.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {TIED_HEAD} if gpt_config.tie_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ShardstackError(
            f"{model_dir}/{WEIGHTS} does not match its {CONFIG}: "
            f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    if gpt_config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, meta
