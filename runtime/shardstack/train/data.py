"""Token shards on disk and a sampler driven by one global sample index.

`prepare` turns text into token files plus `meta.json`, with the byte-level tokenizer (token = byte value, so nothing
is downloaded) or a tokenizer directory (`shardstack tokenizer train`, or a Hugging Face model's): uint16 ids when
the vocabulary fits, else uint32, encoded in parallel worker processes over blocks of the input files. A sample is a
window of seq_len + 1 tokens; windows never straddle a shard. The sampler maps the global sample index g to a window
through a seeded permutation per epoch, and step s always consumes indices [s·B, (s+1)·B) of that stream (B = global
batch), split evenly over the ranks. Its state is just the next index, so resuming on any world size continues the
same stream.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardstack.errors import ShardstackError
from shardstack.model.tokenizer import BYTES, HFTokenizer, copy_files, encode_block, load_tokenizer

CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus"
SHARD_TOKENS = 1 << 26  # 64 Mi tokens per shard file
BLOCK_BYTES = 16 << 20  # the unit of work of one encoding process (cut at a line end)


def _inputs(src: Path) -> list[Path]:
    if src.is_dir():
        files = sorted(p for p in src.rglob("*.txt") if p.is_file())
        if not files:
            raise ShardstackError(f"no *.txt files under {src}")
        return files
    if src.is_file():
        return [src]
    raise ShardstackError(f"input {src} does not exist", hint="give a text file, a directory of *.txt, or nothing "
                          "for the shipped corpus")


def input_files(src: str | Path | None) -> list[Path]:
    """The text files `src` names (a file, a directory of *.txt, or None for the shipped corpus)."""
    return _inputs(Path(src) if src is not None else CORPUS_DIR)


def _blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, end) byte ranges of about `block_bytes` covering the file, each ending after a newline (or at the end)
    so that no character or line is cut."""
    size = path.stat().st_size
    start = 0
    with open(path, "rb") as f:
        while start < size:
            end = min(size, start + block_bytes)
            if end < size:
                f.seek(end)
                tail = f.read(1 << 20)
                cut = tail.find(b"\n")
                if cut < 0:  # no line end near: back off to the start of a UTF-8 character
                    cut = next((i for i in range(min(4, len(tail))) if tail[i] & 0xC0 != 0x80), 0) - 1
                end += cut + 1
            yield start, end
            start = end


def prepare(src: str | Path | None, out: str | Path, *, tokenizer: str = BYTES, shard_tokens: int = SHARD_TOKENS,
            workers: int | None = None, progress: Callable[[int, int], None] | None = None,
            block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Tokenise `src` (a file, a directory of *.txt, or None for the shipped corpus) into `out` with `tokenizer`
    ('bytes' or a tokenizer directory); a tokenizer's EOS, if it has one, ends every file. `progress(done, total)`
    is called with input bytes. Returns the meta.json it writes."""
    files = input_files(src)
    tok = load_tokenizer(tokenizer)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 65535 else np.uint32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("tokens-*.bin"):
        old.unlink()
    spec = str(tokenizer) if tokenizer == BYTES else str(Path(tokenizer).resolve())
    tasks = []
    for f in files:
        blocks = list(_blocks(f, block_bytes)) or [(0, 0)]
        tasks += [(spec, str(f), a, b, i == len(blocks) - 1) for i, (a, b) in enumerate(blocks)]
    total = sum(f.stat().st_size for f in files)
    shards: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []
    held = 0

    def flush(n: int) -> None:
        nonlocal pending, held
        data = np.concatenate(pending) if pending else np.empty(0, dtype)
        name = f"tokens-{len(shards):05d}.bin"
        data[:n].tofile(out / name)
        shards.append({"file": name, "tokens": int(n)})
        pending, held = [data[n:]], len(data) - n

    n_workers = 1 if tok.name == BYTES else max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    # Forked workers start at once with the modules loaded (as DataLoader's do); the byte tokenizer needs none.
    pool = ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("fork")) if n_workers > 1 else None
    try:
        results = pool.map(encode_block, *zip(*tasks, strict=True)) if pool else (encode_block(*t) for t in tasks)
        done = 0
        for raw, nbytes in results:  # in input order, whatever finishes first
            pending.append(np.frombuffer(raw, dtype="<u4").astype(dtype))
            held += len(pending[-1])
            while held >= shard_tokens:
                flush(shard_tokens)
            done += nbytes
            if progress:
                progress(done, total)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    if held or not shards:
        flush(held)
    meta: dict[str, Any] = {
        "format": 1,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "shards": shards,
        "total_tokens": sum(s["tokens"] for s in shards),
        "sources": [str(f) for f in files],
    }
    if isinstance(tok, HFTokenizer):
        # The data directory carries its tokenizer: the trainer and `shardstack export` take it from here.
        copy_files(tok, out)
        meta |= {"tokenizer_sha256": tok.sha256, "tokenizer_source": str(tok.directory), "eos_id": tok.eos_id}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class TokenDataset:
    """Fixed windows of `seq_len + 1` tokens over memory-mapped shards."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise ShardstackError(f"{path} has no meta.json", hint=f"run `shardstack data prepare --out {path}`")
        self.meta = json.loads(meta_file.read_text())
        self.seq_len = seq_len
        self.shards = [np.memmap(path / s["file"], dtype=self.meta["dtype"], mode="r") for s in self.meta["shards"]]
        counts = [max(0, (len(m) - 1) // seq_len) for m in self.shards]
        self.offsets = np.cumsum([0, *counts])
        if self.offsets[-1] == 0:
            raise ShardstackError(f"{path} holds fewer than {seq_len + 1} tokens: no sample of model.seq_len fits")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start: start + self.seq_len + 1], dtype=np.int64)


class GlobalSampler:
    """Hands each rank its share of the global batch for consecutive steps."""

    def __init__(self, num_samples: int, *, global_batch: int, world_size: int, rank: int, seed: int,
                 shuffle: bool = True, sample_index: int = 0) -> None:
        if global_batch % world_size:
            raise ShardstackError(
                f"batch.global_batch ({global_batch}) is not divisible by the world size ({world_size})")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.sample_index = sample_index
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def sample_id(self, g: int) -> int:
        epoch, i = divmod(g, self.num_samples)
        if not self.shuffle:
            return i
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[i])

    def next_indices(self) -> list[int]:
        """This rank's sample ids for the next step, and advance the global index by one global batch."""
        per_rank = self.global_batch // self.world_size
        start = self.sample_index + self.rank * per_rank
        ids = [self.sample_id(g) for g in range(start, start + per_rank)]
        self.sample_index += self.global_batch
        return ids

    def state_dict(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, "seed": self.seed, "num_samples": self.num_samples,
                "shuffle": self.shuffle}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if int(sd["num_samples"]) != self.num_samples or int(sd["seed"]) != self.seed:
            raise ShardstackError(
                f"the checkpoint's data stream (seed {sd['seed']}, {sd['num_samples']} samples) differs from this "
                f"job's (seed {self.seed}, {self.num_samples} samples)",
                hint="resume with the same data.path, model.seq_len and seed",
            )
        self.sample_index = int(sd["sample_index"])


class Batches:
    """Turns sampler ids into (input, target) micro-batches on `device`."""

    def __init__(self, dataset: TokenDataset, sampler: GlobalSampler, micro_batch: int, device: torch.device) -> None:
        per_rank = sampler.global_batch // sampler.world_size
        if per_rank % micro_batch:
            raise ShardstackError(
                f"batch.micro_batch ({micro_batch}) does not divide the per-rank batch ({per_rank} = "
                f"global_batch {sampler.global_batch} / world size {sampler.world_size})")
        self.dataset, self.sampler, self.micro_batch, self.device = dataset, sampler, micro_batch, device

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = self.sampler.next_indices()
        rows = torch.from_numpy(np.stack([self.dataset[i] for i in ids]))
        out = []
        for chunk in rows.split(self.micro_batch):
            x = chunk[:, :-1].contiguous().to(self.device, non_blocking=True)
            y = chunk[:, 1:].contiguous().to(self.device, non_blocking=True)
            out.append((x, y))
        return out
