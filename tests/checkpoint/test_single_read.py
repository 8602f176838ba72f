"""A resume reads each checkpoint file once: the load hashes what it reads (no verification pass before it), and
still deserializes nothing of a file before the whole file has matched the signed manifest. Reads are counted
through an instrumented `open` (every file object the process opens), not by replacing any part of DCP."""

from __future__ import annotations

import builtins
import io
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from shardstack.errors import ShardstackError
from shardstack.signing import SigningKey
from shardstack.train.checkpoint.layout import MANIFEST, list_quarantined, verify_checkpoint
from shardstack.train.checkpoint.reader import CheckpointReader, WeightsOnlyLoadPlanner, dcp_failure
from torch.distributed.checkpoint.api import CheckpointException

from .conftest import AppState, make_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Counted:
    """A file object that adds what is read from it to `counts[path]` (bytes) and `opens[path]`."""

    def __init__(self, f: Any, path: str, nbytes: Counter) -> None:
        self._f, self._path, self._nbytes = f, path, nbytes

    def read(self, *args: Any) -> Any:
        data = self._f.read(*args)
        self._nbytes[self._path] += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._f.readinto(buf)
        self._nbytes[self._path] += n or 0
        return n

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Counter, Counter]:
    """(opens, bytes) per file under tmp_path opened for reading from now on, through open()/io.open/Path.open."""
    real = io.open
    opens: Counter = Counter()
    nbytes: Counter = Counter()

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(file, mode, *args, **kwargs)
        path = str(file) if not isinstance(file, int) else ""
        if path.startswith(str(tmp_path)) and "r" in mode and "+" not in mode:
            opens[path] += 1
            return _Counted(f, path, nbytes)
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return opens, nbytes


def _saved(root: Path, key_file: Path, steps: tuple[int, ...]) -> AppState:
    app = AppState()
    ckpt = make_checkpointer(root, key_file, interval=1, keep=5)
    ckpt.resume(app)
    for step in range(1, max(steps) + 1):
        app.train(1)
        if step in steps:
            assert ckpt.save(app.step, app)
    ckpt.wait()
    return app


def _same(a: AppState, b: AppState) -> bool:
    return all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_a_resume_reads_every_file_of_the_checkpoint_once(tmp_path: Path, key_file: Path,
                                                           reads: tuple[Counter, Counter]) -> None:
    saved = _saved(tmp_path, key_file, (2,))
    step_dir = tmp_path / "step_00000002"
    files = sorted(p for p in step_dir.iterdir() if p.name != MANIFEST)
    assert {p.name for p in files} >= {".metadata", "__0_0.distcp"}
    opens, nbytes = reads
    opens.clear()
    nbytes.clear()

    resumed = AppState(seed=5)
    assert make_checkpointer(tmp_path, key_file).resume(resumed) == 2
    assert _same(saved, resumed)
    for f in files:
        # One open, and every byte once: the sha256 of the load's own read is the only check of the file.
        assert (opens[str(f)], nbytes[str(f)]) == (1, f.stat().st_size), f.name


def test_a_tampered_shard_fails_before_anything_of_it_is_deserialized(
    tmp_path: Path, key_file: Path, key: SigningKey, reads: tuple[Counter, Counter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes of an item change (sizes stay): the manifest and sizes verify, so only the load's hash can tell,
    and it must tell before torch.load has seen any of that file."""
    _saved(tmp_path, key_file, (2,))
    step_dir = tmp_path / "step_00000002"
    shard = step_dir / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))
    assert verify_checkpoint(step_dir, key=key, checksums=False).valid  # signature and sizes: fine

    loads: list[Any] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    opens, _ = reads
    opens.clear()
    fresh = AppState(seed=5)
    untouched = AppState(seed=5)
    with pytest.raises(ShardstackError, match=r"checkpoint\.resume names .*step_00000002, which is not a valid "
                                              r"checkpoint: checksum mismatch for __0_0\.distcp"):
        make_checkpointer(tmp_path, key_file, resume=str(step_dir)).resume(fresh)
    assert loads == []  # nothing of the shard reached torch.load
    assert _same(fresh, untouched) and opens[str(shard)] == 1
    # The reader itself, as the load uses it: the items' bytes are held until the file's digest matched.
    manifest = verify_checkpoint(step_dir, key=key, checksums=False).manifest
    assert manifest is not None
    with pytest.raises(CheckpointException) as err:
        dcp.load(fresh.state_dict(), storage_reader=CheckpointReader(step_dir, manifest["files"]),
                 planner=WeightsOnlyLoadPlanner(), no_dist=True)
    assert dcp_failure(err.value) == "checksum mismatch for __0_0.distcp (sha256 differs from the manifest)"
    assert loads == [] and _same(fresh, untouched)


def test_resume_auto_falls_back_past_a_tampered_newest_and_refuses_to_start_over_on_a_partial_load(
    tmp_path: Path, key_file: Path
) -> None:
    saved = _saved(tmp_path, key_file, (2, 4))
    older = AppState()
    assert make_checkpointer(tmp_path, key_file, resume=str(tmp_path / "step_00000002")).resume(older) == 2
    for step in (4, 2):
        shard = tmp_path / f"step_{step:08d}" / "__0_0.distcp"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        shard.write_bytes(bytes(raw))
        if step == 4:  # an older valid one is there: it is loaded over whatever the failed load left
            resumed = AppState(seed=5)
            assert make_checkpointer(tmp_path, key_file).resume(resumed) == 2
            assert _same(older, resumed) and not _same(saved, resumed)
            assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(4, "checksum-mismatch")]
    # None is left: a load that failed part-way must not become a run from step 0 on top of its leftovers.
    with pytest.raises(ShardstackError, match=r"step_00000002 failed while it was loaded \(checksum mismatch for "
                                              r"__0_0\.distcp .*\) and no older valid checkpoint is left"):
        make_checkpointer(tmp_path, key_file).resume(AppState(seed=5))
    assert [(s, r) for s, r, _ in list_quarantined(tmp_path)] == [(2, "checksum-mismatch"), (4, "checksum-mismatch")]
    # The next attempt starts from step 0 cleanly.
    assert make_checkpointer(tmp_path, key_file).resume(AppState(seed=5)) == 0


def test_metadata_is_read_once_and_a_tampered_one_is_never_unpickled(
    tmp_path: Path, key_file: Path, reads: tuple[Counter, Counter], monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path, key_file, (2,))
    meta = tmp_path / "step_00000002" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-3] ^= 0x01
    meta.write_bytes(bytes(raw))
    unpickled: list[Any] = []
    import shardstack.train.checkpoint.reader as reader

    real = reader.MetadataUnpickler.load
    monkeypatch.setattr(reader.MetadataUnpickler, "load", lambda self: unpickled.append(1) or real(self))
    opens, _ = reads
    opens.clear()
    with pytest.raises(ShardstackError, match=r"checksum mismatch for \.metadata"):
        make_checkpointer(tmp_path, key_file, resume=str(meta.parent)).resume(AppState(seed=5))
    assert unpickled == [] and opens[str(meta)] == 1
