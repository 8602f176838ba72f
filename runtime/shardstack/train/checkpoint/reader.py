"""Reading DCP checkpoints without unpickling anything into live objects beyond plain data.

torch.distributed.checkpoint (torch 2.13) reads `.metadata` with `pickle.load` and every non-tensor item (optimizer
hyper-parameters, our JSON training state) with `torch.load(weights_only=False)`: whoever can write a checkpoint
directory could make the next reader run code. Here:

- `.metadata` goes through `MetadataUnpickler`, which resolves only DCP's metadata dataclasses and the few torch
  values they hold (`torch.Size`, dtypes, layouts), then is checked field by field: every chunk it points at must be
  a shard the manifest lists.
- non-tensor items are loaded with `torch.load(weights_only=True)` (`WeightsOnlyLoadPlanner`); tensor items already
  are, by DCP's `FileSystemReader.read_data`.
- DCP's fallback to a rank-local `__<rank>.metadata` (a file no manifest lists) is never taken.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from shardstack.errors import ShardstackError

DCP_METADATA = ".metadata"

_DCP_METADATA_CLASSES = {
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
}


def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr` as some Python 3.11 releases pickle enum members (`getattr(cls, name)`; Debian 12's 3.11.2 does,
    later 3.11s pickle `cls(value)`): only a member name of an enum the metadata holds."""
    import torch.distributed.checkpoint.metadata as md

    if cls is not md._MEM_FORMAT_ENCODING or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError("it calls getattr on something other than a checkpoint metadata enum member")
    return cls[name]


# (module, name) → what the pickle may reference; nothing else is even imported.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("builtins", "getattr"): _enum_member,
    **{("torch.distributed.checkpoint.metadata", n): None for n in _DCP_METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a name → torch.layout lookup
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},  # pickled by name
}


class MetadataUnpickler(pickle.Unpickler):
    """The standard library's "restricting globals" unpickler for DCP's `.metadata`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which checkpoint metadata never holds")
        found = _ALLOWED[(module, name)]
        if found is None:
            import torch.distributed.checkpoint.metadata as md

            found = getattr(md, name)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which checkpoint metadata never holds")


def _ints(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(v, int) and v >= 0 for v in value)


def _check_metadata(md: Any, files: Collection[str]) -> str | None:
    """What is wrong with an unpickled `.metadata` (types, and shards the manifest does not list), or None."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        return "it is not a DCP Metadata object"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return "it has a non-string key"
        if isinstance(entry, TensorStorageMetadata):
            ok = (isinstance(entry.properties, TensorProperties) and isinstance(entry.properties.dtype, torch.dtype)
                  and _ints(entry.size) and isinstance(entry.chunks, list)
                  and all(isinstance(c, ChunkStorageMetadata) and _ints(c.offsets) and _ints(c.sizes)
                          for c in entry.chunks))
            if not ok:
                return f"its entry for {key!r} is malformed"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"its entry for {key!r} is neither a tensor nor bytes"
    if not isinstance(md.storage_data, dict):
        return "it has no storage map"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "its storage map is malformed"
        if info.relative_path not in files:
            return f"it points at {info.relative_path!r}, which the manifest does not list"
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0):
            return f"its storage entry for {index.fqn!r} has a malformed offset or length"
        if info.transform_descriptors:  # compression etc.: shardstack never writes them
            return f"its storage entry for {index.fqn!r} asks for stream transforms"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return "its storage_meta is malformed"
    return None


def read_dcp_metadata(step_dir: Path, files: Collection[str]) -> Metadata:
    """Unpickle and check `step_dir/.metadata`; `files` are the shard names the (verified) manifest lists."""
    try:
        with open(step_dir / DCP_METADATA, "rb") as f:
            md = MetadataUnpickler(f).load()
    except OSError as exc:
        raise ShardstackError(f"cannot read {step_dir / DCP_METADATA}: {exc.strerror}") from None
    except Exception as exc:  # anything a crafted pickle can raise: it is refused, never half-loaded
        raise ShardstackError(f"DCP {DCP_METADATA} is not checkpoint metadata: {exc}") from None
    problem = _check_metadata(md, files)
    if problem is not None:
        raise ShardstackError(f"DCP {DCP_METADATA} is not checkpoint metadata: {problem}")
    return md


class CheckpointReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through `read_dcp_metadata` once per reader (so every load through it
    sees the metadata that was checked). Its `read_metadata` takes no `rank` argument, which is how DCP knows not to
    fall back to a rank-local `__<rank>.metadata`."""

    def __init__(self, step_dir: str | Path, files: Collection[str]) -> None:
        super().__init__(step_dir)
        self._files = frozenset(files)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self._metadata is None:
            self._metadata = read_dcp_metadata(Path(self.path), self._files)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items are unpickled with `weights_only=True`: plain
    containers, numbers, strings and tensors, never arbitrary objects."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
            why = next((line for line in lines if "unsupported" in line.lower()), lines[0])  # torch names the global
            raise ShardstackError(
                f"the checkpoint item {read_item.dest_index.fqn!r} is not plain data: {why}") from None
        # The rest is DefaultLoadPlanner.load_bytes.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_failure(exc: CheckpointException) -> str:
    """The first rank's error of a failed DCP load, in one line (DCP's own message is every rank's traceback)."""
    for err, _trace in exc.failures.values():
        if isinstance(err, ShardstackError):
            return str(err)
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[0] if lines else ''}"
    return "DCP reported a failure without an error"
