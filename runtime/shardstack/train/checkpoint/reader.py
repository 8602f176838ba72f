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

Files are hashed as they are read, once: `.metadata` is read into memory, hashed and unpickled from those bytes, and
each shard a resume needs streams once through sha256 while the byte ranges of its items are kept; they are
deserialized only after the whole file has matched the (signed) manifest (`CheckpointReader(verify_reads=True)`).
So a resume reads every file once (not a hashing pass and then a loading one), nothing unverified is deserialized,
and the bytes checked are the bytes loaded, not a copy read a moment earlier.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
import pickle
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardstack.errors import ShardstackError

DCP_METADATA = ".metadata"
_CHUNK = 4 * 2**20  # bytes hashed per read between the items a rank loads


class ChecksumMismatch(ShardstackError):
    """A file's bytes, as read, differ from the manifest's size or sha256."""

    def __init__(self, name: str) -> None:
        super().__init__(f"checksum mismatch for {name} (sha256 differs from the manifest)")
        self.name = name

    def __reduce__(self) -> tuple[Any, tuple[str]]:  # DCP gathers ranks' errors pickled: keep the name, not the text
        return type(self), (self.name,)

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
    # StorageMeta.checkpoint_id, under the module it is pickled from: pathlib up to Python 3.12, pathlib._local from
    # 3.13 (Debian 13), so a checkpoint from either release's nodes loads on the other's.
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
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


def read_dcp_metadata(step_dir: Path, files: Mapping[str, Mapping[str, Any]]) -> Metadata:
    """Read `step_dir/.metadata` once, check its sha256 against `files` (the verified manifest's entries), then
    unpickle those same bytes and check them: every chunk must point at a shard the manifest lists."""
    path = step_dir / DCP_METADATA
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ShardstackError(f"cannot read {path}: {exc.strerror}") from None
    expected = files.get(DCP_METADATA)
    if expected is None or len(raw) != expected["size"] or hashlib.sha256(raw).hexdigest() != expected["sha256"]:
        raise ChecksumMismatch(DCP_METADATA)
    try:
        md = MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # anything a crafted pickle can raise: it is refused, never half-loaded
        raise ShardstackError(f"DCP {DCP_METADATA} is not checkpoint metadata: {exc}") from None
    problem = _check_metadata(md, [n for n in files if n != DCP_METADATA])
    if problem is not None:
        raise ShardstackError(f"DCP {DCP_METADATA} is not checkpoint metadata: {problem}")
    return md


class _HashingFile:
    """One shard read front to back exactly once through sha256: `items` yields the requested (offset, length)
    ranges in file order, `finish` hashes the rest and compares size and digest with the manifest."""

    def __init__(self, f: BinaryIO, name: str, expected: Mapping[str, Any]) -> None:
        self.f, self.name, self.expected = f, name, expected
        self.pos = 0
        self.sha = hashlib.sha256()

    def _take(self, n: int) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        self.pos += len(data)
        return data

    def skip_to(self, offset: int) -> None:
        while self.pos < offset:
            if not self._take(min(_CHUNK, offset - self.pos)):
                raise ShardstackError(f"{self.name} ends before offset {offset} that .metadata points at")

    def read(self, length: int) -> bytes:
        data = self._take(length)
        if len(data) != length:
            raise ShardstackError(f"{self.name} ends inside an item that .metadata points at (truncated?)")
        return data

    def finish(self) -> None:
        while self._take(_CHUNK):
            pass
        if self.pos != self.expected["size"] or self.sha.hexdigest() != self.expected["sha256"]:
            raise ChecksumMismatch(self.name)


class CheckpointReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through `read_dcp_metadata` once per reader (so every load through it
    sees the metadata that was checked). Its `read_metadata` takes no `rank` argument, which is how DCP knows not to
    fall back to a rank-local `__<rank>.metadata`.

    `files` are the signed manifest's entries ({name: {size, sha256}}). With `verify_reads` each shard a load
    touches is read once, front to back, through sha256, keeping the byte ranges of the items this rank loads; only
    when the whole file has matched the manifest are they deserialized (weights-only), so a file whose bytes differ
    fails the load (`ChecksumMismatch`) with nothing of it deserialized. This is the resume's only read of the
    shards: a rank holds the needed bytes of one file at a time in memory (about its share of the state, the
    price of not reading everything twice), and reads the parts of shards it does not need (rank 0's file holds the
    plain items every rank loads). `export`, which loads one tensor at a time, verifies up front instead
    (`verify_reads=False`).
    """

    def __init__(self, step_dir: str | Path, files: Mapping[str, Mapping[str, Any]], *,
                 verify_reads: bool = True) -> None:
        super().__init__(step_dir)
        self._files = dict(files)
        self._verify_reads = verify_reads
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self._metadata is None:
            self._metadata = read_dcp_metadata(Path(self.path), self._files)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self._verify_reads:
            return super().read_data(plan, planner)
        per_file: dict[str, list[tuple[_StorageInfo, ReadItem]]] = {}
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append((info, req))
        for name, reqs in per_file.items():
            if name not in self._files:  # _check_metadata already refused this; never open an unlisted file
                raise ShardstackError(f".metadata points at {name!r}, which the manifest does not list")
            held: list[tuple[ReadItem, bytes]] = []
            with open(Path(self.path) / name, "rb") as f:
                stream = _HashingFile(f, name, self._files[name])
                for info, req in _in_file_order(reqs):
                    stream.skip_to(info.offset)
                    held.append((req, stream.read(info.length)))
                stream.finish()  # raises before anything of this file is deserialized
            held.reverse()
            while held:  # release each item's bytes as it is loaded
                req, data = held.pop()
                _deliver(req, data, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _in_file_order(reqs: list[tuple[_StorageInfo, ReadItem]]) -> Iterator[tuple[_StorageInfo, ReadItem]]:
    """The requests by offset; overlapping items (never written by DCP) are refused rather than read twice."""
    end = 0
    for info, req in sorted(reqs, key=lambda r: r[0].offset):
        if info.offset < end:
            raise ShardstackError(f"{info.relative_path} has overlapping items in .metadata")
        end = info.offset + info.length
        yield info, req


def _deliver(req: ReadItem, data: bytes, planner: LoadPlanner) -> None:
    """DCP's FileSystemReader.read_data for one item, from bytes already read (transforms are refused in
    _check_metadata); tensors weights-only, as DCP does, and plain items through the planner's load_bytes."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))
        return
    tensor = cast(torch.Tensor, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise ShardstackError(f"item {req.storage_index.fqn!r} has shape {tuple(tensor.size())} in the checkpoint, "
                              f"{tuple(target.size())} here")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


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
