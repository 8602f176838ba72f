"""Export a sharded training checkpoint to the model artifact (shardstack.model.artifact) for serving.

The export runs on a single process with no process group. It reads the DCP metadata, then loads the model's
tensors one at a time (DCP reads only the byte ranges of that tensor's chunks, whatever world size wrote them) and
the artifact writer streams each straight into `model.safetensors`. Host memory therefore peaks at about one full
tensor plus the chunk being read, never the whole model: bench/RESULTS.md has the measured figure. The optimizer
state in the checkpoint is never read.
"""

from __future__ import annotations

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
from shardstack.train.checkpoint.layout import DCP_METADATA, CheckpointInfo, resolve_checkpoint
from shardstack.train.checkpoint.reader import CheckpointReader, WeightsOnlyLoadPlanner, dcp_failure
from shardstack.train.checkpoint.signing import SigningKey
from shardstack.train.memory.host import peak_rss_bytes

log = logging.getLogger("shardstack.export")

MODEL_PREFIX = "model."  # the trainer's app state keeps the model under "model"; DCP flattens with dots


@dataclass
class ExportResult:
    out: Path
    step: int
    tensors: int
    bytes_written: int
    largest_tensor_bytes: int
    peak_rss_bytes: int  # this process's peak resident set size (whole process, including the interpreter)
    seconds: float


def _model_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields from the job config the trainer recorded in the manifest."""
    job = manifest.get("job_config")
    if not isinstance(job, dict) or not isinstance(job.get("model"), dict):
        raise ShardstackError(
            "the checkpoint's manifest.json has no job config, so the model's shape is unknown",
            hint="checkpoints written by `shardstack train` record it; this one was written by something else",
        )
    from shardstack.model.factory import gpt_fields
    from shardstack.train.config import config_from_dict

    model = config_from_dict({"model": job["model"]}).model
    if model.factory:
        raise ShardstackError(
            f"the checkpoint holds a user model ({model.factory}); export supports the built-in GPT",
            hint="load the checkpoint with torch.distributed.checkpoint in your own code",
        )
    return gpt_fields(model)


def export_checkpoint(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, key: SigningKey | None, dtype: str = "float32",
    verify: bool = True,
) -> ExportResult:
    """Write the artifact to OUT from a checkpoint (a step dir, or a root: its newest valid checkpoint). `key` None
    skips the signature check (an explicit opt-out); `verify` False checks sizes instead of sha256."""
    t0 = time.monotonic()
    if dtype not in DTYPES:
        raise ShardstackError(f"unknown export dtype {dtype!r}", hint=f"one of {', '.join(DTYPES)}")
    info: CheckpointInfo = resolve_checkpoint(checkpoint, key=key, checksums=verify)
    assert info.manifest is not None
    fields = _model_fields(info.manifest)

    reader = CheckpointReader(info.path, [n for n in info.manifest["files"] if n != DCP_METADATA])
    metadata = reader.read_metadata().state_dict_metadata
    shapes = {fqn[len(MODEL_PREFIX):]: md for fqn, md in metadata.items()
              if fqn.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    names = artifact.stored_names(list(shapes), fields)
    if not names:
        raise ShardstackError(f"checkpoint {info.path} holds no model tensors (no '{MODEL_PREFIX}*' keys)")

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

    config = {"model": fields, "step": info.step, "dtype": dtype, "source_checkpoint": str(info.path),
              "tokenizer": "bytes"}
    stats = artifact.write(out, [(n, shapes[n].size) for n in names], read, dtype=DTYPES[dtype], config=config,
                           header_meta={"step": str(info.step), "source_checkpoint": str(info.path)})
    result = ExportResult(out=Path(out), step=info.step, tensors=len(names), bytes_written=stats.bytes_written,
                          largest_tensor_bytes=stats.largest_tensor_bytes, peak_rss_bytes=peak_rss_bytes(),
                          seconds=time.monotonic() - t0)
    log.info("exported step %d from %s to %s: %d tensors, %.1f MiB in %.1fs", info.step, info.path, out,
             result.tensors, stats.bytes_written / 2**20, result.seconds)
    return result
