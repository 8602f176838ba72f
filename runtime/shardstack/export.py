"""Export a sharded training checkpoint to one consolidated safetensors file (+ config.json) for serving.

The export runs on a single process with no process group. It reads the DCP metadata, then loads the model's
tensors one at a time (DCP reads only the byte ranges of that tensor's chunks, whatever world size wrote them) and
streams each straight into `model.safetensors`, whose header is computed up front from the metadata. Host memory
therefore peaks at about one full tensor plus the chunk being read, never the whole model: bench/RESULTS.md has
the measured figure. The optimizer state in the checkpoint is never read.

Output (what `load_model` and `shardstack serve` read)::

    OUT/model.safetensors   keys exactly as GPT.state_dict() of an unwrapped model; a tied lm_head.weight is
                            stored once, as tok_emb.weight
    OUT/config.json         {"model": GPTConfig fields, "step", "dtype", "source_checkpoint", "tokenizer": "bytes"}
"""

from __future__ import annotations

import json
import logging
import os
import resource
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardstack.checkpoint import CheckpointInfo, resolve_checkpoint
from shardstack.errors import ShardstackError

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the trainer's app state keeps the model under "model"; DCP flattens with dots
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPE: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class ExportResult:
    out: Path
    step: int
    tensors: int
    bytes_written: int
    largest_tensor_bytes: int
    peak_rss_bytes: int  # this process's peak resident set size (whole process, including the interpreter)
    seconds: float


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across
    fork + exec, so a small process started by a big one would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def tune_allocator() -> None:
    """Make glibc return each freed tensor buffer to the OS at once (call it in a process that exports).

    glibc raises its mmap threshold every time a large mmapped block is freed, so after the first few tensors
    later ones come from the heap, which does not shrink: the process's peak then creeps up with the model's size
    instead of staying near the largest tensor. A fixed 1 MiB threshold keeps every tensor buffer mmapped.
    """
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, 1 << 20)


def _model_config(manifest: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields from the job config the trainer recorded in the manifest."""
    job = manifest.get("job_config")
    if not isinstance(job, dict) or not isinstance(job.get("model"), dict):
        raise ShardstackError(
            "the checkpoint's manifest.json has no job config, so the model's shape is unknown",
            hint="checkpoints written by `shardstack train` record it; this one was written by something else",
        )
    from shardstack.config import config_from_dict, model_config_dict

    model = config_from_dict({"model": job["model"]}).model
    if model.factory:
        raise ShardstackError(
            f"the checkpoint holds a user model ({model.factory}); export supports the built-in GPT",
            hint="load the checkpoint with torch.distributed.checkpoint in your own code",
        )
    return model_config_dict(model)


def _safetensors_header(entries: list[tuple[str, torch.Size]], dtype: torch.dtype, meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    width = torch.empty((), dtype=dtype).element_size()
    for name, shape in entries:
        nbytes = width * int(torch.Size(shape).numel())
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces so tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def export_checkpoint(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32", verify: bool = True
) -> ExportResult:
    """Write OUT/model.safetensors and OUT/config.json from a checkpoint (a step dir, or a root: newest valid)."""
    t0 = time.monotonic()
    if dtype not in _DTYPES:
        raise ShardstackError(f"unknown export dtype {dtype!r}", hint=f"one of {', '.join(_DTYPES)}")
    target_dtype = _DTYPES[dtype]
    info: CheckpointInfo = resolve_checkpoint(checkpoint, checksums=verify)
    assert info.manifest is not None
    model_cfg = _model_config(info.manifest)

    reader = dcp.FileSystemReader(str(info.path))
    metadata = reader.read_metadata()
    tensors: list[tuple[str, str, TensorStorageMetadata]] = []  # (checkpoint key, export name, metadata)
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            name = key[len(MODEL_PREFIX) :]
            if name == "lm_head.weight" and model_cfg.get("tie_embeddings", True):
                continue  # the same tensor as tok_emb.weight; load_model re-ties it
            tensors.append((key, name, md))
    if not tensors:
        raise ShardstackError(f"checkpoint {info.path} holds no model tensors (no '{MODEL_PREFIX}*' keys)")
    tensors.sort(key=lambda t: t[1])
    header = _safetensors_header(
        [(name, md.size) for _, name, md in tensors], target_dtype,
        {"format": "pt", "step": str(info.step), "source_checkpoint": str(info.path)},
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    written = largest = 0
    with open(tmp, "wb") as f:
        f.write(header)
        for key, _name, md in tensors:
            # One tensor at a time: DCP loads just this key's chunks into `buf` (no process group needed).
            buf = torch.empty(md.size, dtype=md.properties.dtype)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load({key: buf}, storage_reader=reader, no_dist=True)
            largest = max(largest, buf.numel() * buf.element_size())
            data = buf.to(target_dtype).contiguous()
            del buf
            f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            written += data.numel() * data.element_size()
            del data
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "model.safetensors")
    config = {
        "model": model_cfg,
        "step": info.step,
        "dtype": dtype,
        "source_checkpoint": str(info.path),
        "tokenizer": "bytes",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    result = ExportResult(out=out, step=info.step, tensors=len(tensors), bytes_written=written,
                          largest_tensor_bytes=largest, peak_rss_bytes=_peak_rss_bytes(),
                          seconds=time.monotonic() - t0)
    log.info("exported step %d from %s to %s: %d tensors, %.1f MiB in %.1fs", info.step, info.path, out,
             result.tensors, written / 2**20, result.seconds)
    return result


def load_model(model_dir: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[Any, dict[str, Any]]:
    """The exported GPT (eval mode, on `device` in `dtype`) and its config.json; raises ShardstackError if broken."""
    from safetensors.torch import load_file

    from shardstack.model import GPT, GPTConfig

    model_dir = Path(model_dir)
    try:
        meta = json.loads((model_dir / "config.json").read_text())
        gpt_config = GPTConfig(**meta["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShardstackError(f"{model_dir}/config.json is not an export config: {exc}",
                              hint="point at the output of `shardstack export`") from exc
    with torch.device("meta"):
        model = GPT(gpt_config)
    state = load_file(str(model_dir / "model.safetensors"), device=str(device))
    # assign=True adopts the loaded tensors (no second copy); the tied head is re-tied below.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if gpt_config.tie_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ShardstackError(
            f"{model_dir}/model.safetensors does not match its config.json: "
            f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    if gpt_config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, meta
