"""Export a sharded training checkpoint to a model directory (shardstack.model.artifact): our format for serving, or
the Hugging Face layout (`fmt="hf"`, Llama) that transformers loads.

The export runs on a single process with no process group. It reads the DCP metadata, then loads the model's
tensors one at a time (DCP reads only the byte ranges of that tensor's chunks, whatever world size wrote them) and
the artifact writer streams each straight into `model.safetensors`. Host memory therefore peaks at about one full
tensor plus the chunk being read, never the whole model: bench/RESULTS.md has the measured figure. The optimizer
state in the checkpoint is never read.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardstack.errors import ShardstackError
from shardstack.model import artifact
from shardstack.model.dtypes import DTYPES
from shardstack.model.manifest import write_manifest
from shardstack.model.spec import ARCHS, arch_config, model_arch
from shardstack.model.tokenizer import BYTES, HFTokenizer
from shardstack.signing import SigningKey
from shardstack.train.checkpoint.layout import CheckpointInfo, resolve_checkpoint
from shardstack.train.checkpoint.reader import CheckpointReader, WeightsOnlyLoadPlanner, dcp_failure
from shardstack.train.config import JobConfig, config_from_dict
from shardstack.train.memory.host import peak_rss_bytes

log = logging.getLogger("shardstack.export")

MODEL_PREFIX = "model."  # the trainer's app state keeps the model under "model"; DCP flattens with dots


@dataclass
class ExportResult:
    out: Path
    step: int
    tensors: int
    files: int
    bytes_written: int
    largest_tensor_bytes: int
    peak_rss_bytes: int  # this process's peak resident set size (whole process, including the interpreter)
    seconds: float


def _job(manifest: dict[str, Any]) -> JobConfig:
    """The job config the trainer recorded in the manifest (the model's shape and the data's tokenizer)."""
    job = manifest.get("job_config")
    if not isinstance(job, dict) or not isinstance(job.get("model"), dict):
        raise ShardstackError(
            "the checkpoint's manifest.json has no job config, so the model's shape is unknown",
            hint="checkpoints written by `shardstack train` record it; this one was written by something else",
        )
    cfg = config_from_dict({"model": job["model"], "data": job.get("data") or {}})
    if cfg.model.factory:
        raise ShardstackError(
            f"the checkpoint holds a user model ({cfg.model.factory}); export supports the built-in architectures",
            hint="load the checkpoint with torch.distributed.checkpoint in your own code",
        )
    return cfg


def _tokenizer(job: JobConfig, override: str | None) -> HFTokenizer | None:
    """The tokenizer the job trained with: --tokenizer, else the one `data prepare` put in data.path (None: bytes)."""
    if override is not None:
        return None if override == BYTES else HFTokenizer(override)
    if not job.data.path:
        return None
    meta_file = Path(job.data.path) / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"cannot read the job's tokenizer from {meta_file} ({exc})",
                              hint="pass --tokenizer DIR (or bytes) to name it") from None
    return None if meta.get("tokenizer", BYTES) == BYTES else HFTokenizer(job.data.path)


def export_checkpoint(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, key: SigningKey | None, dtype: str = "float32",
    verify: bool = True, fmt: str = "shardstack", tokenizer: str | None = None,
    max_shard_bytes: int = artifact.MAX_SHARD_BYTES,
) -> ExportResult:
    """Write OUT from a checkpoint (a step dir, or a root: its newest valid checkpoint), in our format or ("hf") the
    Hugging Face layout (in files of at most `max_shard_bytes`); `tokenizer` overrides the job's ('bytes' or a
    directory). `key` checks the checkpoint's signature and signs the export's manifest; None (an explicit opt-out)
    does neither. `verify` False checks sizes instead of sha256."""
    t0 = time.monotonic()
    if dtype not in DTYPES:
        raise ShardstackError(f"unknown export dtype {dtype!r}", hint=f"one of {', '.join(DTYPES)}")
    if fmt not in artifact.FORMATS:
        raise ShardstackError(f"unknown export format {fmt!r}", hint=f"one of {', '.join(artifact.FORMATS)}")
    info: CheckpointInfo = resolve_checkpoint(checkpoint, key=key, checksums=verify)
    assert info.manifest is not None
    job = _job(info.manifest)
    arch, model_config = model_arch(job.model), arch_config(job.model)
    if fmt == "hf" and not ARCHS[arch].hf:
        raise ShardstackError(f"--format hf writes Llama models; this checkpoint holds arch {arch}",
                              hint="export it with --format shardstack")
    fields = model_config.to_dict()
    tok = _tokenizer(job, tokenizer)

    # One tensor per load keeps export's memory bounded; streaming every shard through sha256 on each would read
    # the checkpoint once per tensor, so its shards are verified up front (resolve_checkpoint) and .metadata on read.
    reader = CheckpointReader(info.path, info.manifest["files"], verify_reads=False)
    metadata = reader.read_metadata().state_dict_metadata
    shapes = {fqn[len(MODEL_PREFIX):]: md for fqn, md in metadata.items()
              if fqn.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    names = artifact.stored_names(list(shapes), fields)
    if not names:
        raise ShardstackError(f"checkpoint {info.path} holds no model tensors (no '{MODEL_PREFIX}*' keys)")
    if fmt == "hf":
        artifact.check_hf_names(names, model_config, where=f"checkpoint {info.path}")

    def read(name: str) -> torch.Tensor:
        # One tensor at a time: DCP loads just this key's chunks into `buf` (no process group needed).
        md = shapes[name]
        buf = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            try:
                dcp.load({MODEL_PREFIX + name: buf}, storage_reader=reader, planner=WeightsOnlyLoadPlanner(),
                         no_dist=True)
            except CheckpointException as exc:
                raise ShardstackError(f"cannot read {name} from checkpoint {info.path}: {dcp_failure(exc)}") from None
        return buf

    entries = [(n, shapes[n].size) for n in names]
    header = {"step": str(info.step), "source_checkpoint": str(info.path)}
    if fmt == "hf":
        stats = artifact.write_hf(out, entries, read, model=model_config, dtype=DTYPES[dtype], header_meta=header,
                                  tokenizer=tok, max_shard_bytes=max_shard_bytes)
    else:
        config = {"arch": arch, "model": fields, "step": info.step, "dtype": dtype,
                  "source_checkpoint": str(info.path), "tokenizer": tok.name if tok else BYTES}
        stats = artifact.write(out, entries, read, dtype=DTYPES[dtype], config=config, header_meta=header,
                               tokenizer=tok)
    # Last: the signed manifest covers every file written above (serving refuses an export that does not verify).
    write_manifest(out, key, step=info.step, source=str(info.path))
    result = ExportResult(out=Path(out), step=info.step, tensors=len(names), files=stats.files,
                          bytes_written=stats.bytes_written,
                          largest_tensor_bytes=stats.largest_tensor_bytes, peak_rss_bytes=peak_rss_bytes(),
                          seconds=time.monotonic() - t0)
    log.info("exported step %d from %s to %s: %d tensors, %.1f MiB in %.1fs, manifest %s", info.step, info.path, out,
             result.tensors, stats.bytes_written / 2**20, result.seconds,
             f"signed (key id {key.key_id})" if key else "unsigned (--allow-unsigned)")
    return result
