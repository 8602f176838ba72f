"""Token shards on disk and a sampler driven by one global sample index.

`prepare` turns text into uint16 token files (byte-level tokenizer: token = byte value, so nothing is downloaded)
plus `meta.json`. A sample is a window of seq_len + 1 tokens; windows never straddle a shard. The sampler maps the
global sample index g to a window through a seeded permutation per epoch, and step s always consumes indices
[s·B, (s+1)·B) of that stream (B = global batch), split evenly over the ranks. Its state is just the next index, so
resuming on any world size continues the same stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardstack.errors import ShardstackError

CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus"
TOKEN_DTYPE = np.uint16
SHARD_TOKENS = 1 << 26  # 64 Mi tokens (128 MiB) per shard file


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


def prepare(src: str | Path | None, out: str | Path, *, shard_tokens: int = SHARD_TOKENS) -> dict[str, Any]:
    """Tokenise `src` (a file, a directory of *.txt, or None for the shipped corpus) into `out`. Returns meta."""
    files = _inputs(Path(src) if src is not None else CORPUS_DIR)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("tokens-*.bin"):
        old.unlink()
    shards: list[dict[str, Any]] = []
    buf = bytearray()

    def flush() -> None:
        name = f"tokens-{len(shards):05d}.bin"
        np.frombuffer(bytes(buf), dtype=np.uint8).astype(TOKEN_DTYPE).tofile(out / name)
        shards.append({"file": name, "tokens": len(buf)})
        buf.clear()

    for f in files:
        buf += f.read_bytes()
        while len(buf) >= shard_tokens:
            rest = buf[shard_tokens:]
            del buf[shard_tokens:]
            flush()
            buf += rest
    if buf or not shards:
        flush()
    meta = {
        "format": 1,
        "tokenizer": "bytes",
        "vocab_size": 256,
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "shards": shards,
        "total_tokens": sum(s["tokens"] for s in shards),
        "sources": [str(f) for f in files],
    }
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
