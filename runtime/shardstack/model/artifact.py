"""The exported-model formats, with one owner here: what `shardstack export` writes, what `shardstack serve` loads,
and the Hugging Face directories training starts from (`model.init_from`).

shardstack (the default export; the server's format):
    DIR/model.safetensors   keys exactly as the model's state_dict() (unwrapped); a tied lm_head.weight is stored
                            once, as tok_emb.weight
    DIR/config.json         {"arch": "gpt" | "llama", "model": its config fields, "step", "dtype", "source_checkpoint",
                             "tokenizer": "bytes" or the tokenizer's name}; no "arch" (older exports) means gpt
    DIR/tokenizer.json …    the job's tokenizer files, when it trained with one
hf (Llama; what transformers' AutoModelForCausalLM.from_pretrained loads):
    DIR/config.json, DIR/generation_config.json, DIR/tokenizer.json …
    DIR/model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json when the weights
    exceed one file's `max_shard_bytes`

Writing streams: each file's safetensors header is computed up front from the names and shapes, then each tensor is
fetched by the caller's `read` and written in turn, so host memory holds about one tensor at a time. Reading a
Hugging Face directory goes through torch DCP's HuggingFaceStorageReader, which reads only the rows each rank's
(DTensor) shard needs.
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
from torch import nn

from shardstack.errors import ShardstackError
from shardstack.model import hf
from shardstack.model.decoder import arch_spec
from shardstack.model.dtypes import SAFETENSORS, dtype_name
from shardstack.model.init import to_empty
from shardstack.model.llama import Llama
from shardstack.model.shapes import LlamaConfig
from shardstack.model.spec import build_arch
from shardstack.model.tokenizer import BYTES, HFTokenizer, copy_files

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TIED_HEAD = "lm_head.weight"  # stored once, as tok_emb.weight, when embeddings are tied
FORMATS = ("shardstack", "hf")
MAX_SHARD_BYTES = 5 << 30  # transformers' default max_shard_size (5 GB)


@dataclass
class WriteStats:
    bytes_written: int
    largest_tensor_bytes: int  # the largest tensor as `read` returned it (before the cast to the export dtype)
    files: int = 1


Read = Callable[[str], torch.Tensor]


def stored_names(names: list[str], model_fields: dict[str, Any]) -> list[str]:
    """The state-dict keys an export stores: a tied head is left out (loading re-ties it)."""
    tied = model_fields.get("tie_embeddings", True)
    return sorted(n for n in names if not (tied and n == TIED_HEAD))


def _nbytes(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())


def _header(entries: list[tuple[str, torch.Size]], dtype: torch.dtype, meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, shape in entries:
        nbytes = _nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces so tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_file(path: Path, entries: list[tuple[str, torch.Size]], read: Read, dtype: torch.dtype,
                meta: dict[str, str], names: Callable[[str], str] = str) -> tuple[int, int]:
    """One safetensors file, tensor by tensor (`entries` hold the names `read` takes; `names` maps them to the names
    stored). The file appears under its name only once complete and fsynced. Returns (bytes written, largest)."""
    tmp = path.with_name(path.name + ".tmp")
    written = largest = 0
    with open(tmp, "wb") as f:
        f.write(_header([(names(n), s) for n, s in entries], dtype, {"format": "pt", **meta}))
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
    os.replace(tmp, path)
    return written, largest


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write(out: str | os.PathLike, entries: list[tuple[str, torch.Size]], read: Read, *,
          dtype: torch.dtype, config: dict[str, Any], header_meta: dict[str, str],
          tokenizer: HFTokenizer | None = None) -> WriteStats:
    """Our format: OUT/model.safetensors (tensors in `entries` order, each from `read(name)`, cast to `dtype`),
    OUT/config.json and the tokenizer's files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, largest = _write_file(out / WEIGHTS, entries, read, dtype, header_meta)
    _write_json(out / CONFIG, config)
    if tokenizer is not None:
        copy_files(tokenizer, out)
    return WriteStats(written, largest)


def check_hf_names(names: list[str], model: LlamaConfig, *, where: str) -> None:
    """`names` (ours, as stored_names gives them) are exactly the tensors a Hugging Face directory of `model` holds."""
    theirs = {}
    for name in names:
        try:
            theirs[hf.to_hf(name)] = name
        except KeyError:
            raise ShardstackError(f"{where}: tensor {name} has no Hugging Face Llama name") from None
    expected = hf.expected_tensors(model)
    missing = [n for n in expected if n not in theirs]
    if missing or len(theirs) != len(expected):
        raise ShardstackError(f"{where} does not hold the Llama its config describes (missing {missing[:3]})")


def write_hf(out: str | os.PathLike, entries: list[tuple[str, torch.Size]], read: Read, *, model: LlamaConfig,
             dtype: torch.dtype, header_meta: dict[str, str], tokenizer: HFTokenizer | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> WriteStats:
    """The Hugging Face layout of a Llama whose tensors `entries` lists under our names (a tied head left out, as
    `stored_names` does); `read` takes our names. Files of at most `max_shard_bytes` (a larger tensor gets its own)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = _nbytes(shape, dtype)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    files = [hf.SINGLE] if len(groups) == 1 else \
        [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    for stale in [*out.glob("model*.safetensors"), out / hf.INDEX]:  # a previous export's shards would be mixed in
        stale.unlink(missing_ok=True)
    written = largest = 0
    weight_map: dict[str, str] = {}
    for file, group in zip(files, groups, strict=True):
        w, big = _write_file(out / file, group, read, dtype, header_meta, names=hf.to_hf)
        written, largest = written + w, max(largest, big)
        weight_map |= {hf.to_hf(n): file for n, _ in group}
    if len(files) > 1:
        _write_json(out / hf.INDEX, {"metadata": {"total_size": written}, "weight_map": weight_map})
    bos = tokenizer.bos_id if tokenizer else None
    eos = tokenizer.eos_id if tokenizer else None
    _write_json(out / hf.CONFIG, hf.config_json(model, dtype, bos_token_id=bos, eos_token_id=eos))
    _write_json(out / hf.GENERATION_CONFIG, {"bos_token_id": bos, "eos_token_id": eos})
    if tokenizer is not None:
        copy_files(tokenizer, out)
    return WriteStats(written, largest, files=len(files))


def arch_of(model: nn.Module) -> str:
    spec = arch_spec(model)
    if spec is None:
        raise ShardstackError(f"{type(model).__name__} is not a built-in architecture; exports hold gpt or llama")
    return spec.name


def save_model(model: nn.Module, out: str | os.PathLike, *, step: int, source: str,
               dtype: torch.dtype = torch.float32, fmt: str = "shardstack",
               tokenizer: HFTokenizer | None = None) -> Path:
    """An in-memory GPT or Llama as an export (tests, benchmarks, and trying the service before a training run)."""
    fields = model.config.to_dict()
    state = model.state_dict()
    names = stored_names(list(state), fields)
    entries = [(n, state[n].shape) for n in names]
    meta = {"step": str(step), "source_checkpoint": source}
    if fmt == "hf":
        spec = arch_spec(model)
        if spec is None or not spec.hf:
            raise ShardstackError(f"--format hf writes Llama models; this is {type(model).__name__}")
        write_hf(out, entries, lambda n: state[n].detach(), model=model.config, dtype=dtype, header_meta=meta,
                 tokenizer=tokenizer)
    else:
        config = {"arch": arch_of(model), "model": fields, "step": step, "dtype": dtype_name(dtype),
                  "source_checkpoint": source, "tokenizer": tokenizer.name if tokenizer else BYTES}
        write(out, entries, lambda n: state[n].detach(), dtype=dtype, config=config, header_meta=meta,
              tokenizer=tokenizer)
    return Path(out)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path / CONFIG} is unreadable: {exc}") from None


def is_hf_dir(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory (its config.json names `architectures`/`model_type`), not one of ours."""
    config = _read_config(Path(path))
    return "model" not in config and ("architectures" in config or "model_type" in config)


def check_model_dir(path: Path) -> None:
    """Fail with a clear message unless `path` looks like an export of ours or a Hugging Face directory (before
    anything heavy is imported)."""
    hint = "point --model at the output of `shardstack export` or a Hugging Face Llama directory"
    if not path.is_dir():
        raise ShardstackError(f"model directory {path} does not exist", hint=hint)
    if not (path / CONFIG).is_file():
        raise ShardstackError(f"{path} has no {CONFIG}", hint=hint)
    if is_hf_dir(path):
        hf.weight_files(path)
    elif not (path / WEIGHTS).is_file():
        raise ShardstackError(f"{path} has no {WEIGHTS}", hint=hint)


def load_hf_weights(model: nn.Module, directory: str | os.PathLike) -> None:
    """Fill a Llama's parameters — whole tensors, or this rank's DTensor shards — from a checked Hugging Face
    directory, streaming: DCP plans which rows each rank needs and reads just those slices of each file, casting to
    the parameters' dtype."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {hf.to_hf(name): p for name, p in model.named_parameters()}
    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=alone)


def load_model(model_dir: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict[str, Any]]:
    """The exported model (eval mode, on `device` in `dtype`) and its config: an export of ours (GPT or Llama) or a
    Hugging Face Llama directory (checked first). Raises ShardstackError if broken."""
    model_dir = Path(model_dir)
    if is_hf_dir(model_dir):
        config = hf.read_config(model_dir)
        hf.check_weights(model_dir, config)
        with torch.device("meta"):
            model = Llama(config.model).to(dtype)
        to_empty(model, device)
        load_hf_weights(model, model_dir)
        tokenizer = HFTokenizer(model_dir).name if (model_dir / "tokenizer.json").is_file() else None
        meta = {"arch": "llama", "model": config.model.to_dict(), "step": None, "dtype": dtype_name(dtype),
                "source_checkpoint": None, "tokenizer": tokenizer, "format": "hf"}
        return model.eval(), meta
    from safetensors.torch import load_file

    meta = _read_config(model_dir)
    try:
        with torch.device("meta"):
            model = build_arch(meta.get("arch", "gpt"), meta["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardstackError(f"{model_dir}/{CONFIG} is not an export config: {exc!r}",
                              hint="point at the output of `shardstack export`") from None
    tied = model.config.tie_embeddings
    state = load_file(str(model_dir / WEIGHTS), device=str(device))
    # assign=True adopts the loaded tensors (no second copy); the tied head is re-tied below.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {TIED_HEAD} if tied else set()
    if unexpected or set(missing) - allowed_missing:
        raise ShardstackError(
            f"{model_dir}/{WEIGHTS} does not match its {CONFIG}: "
            f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, meta
