"""Room for one more checkpoint: before each save every rank reports the free space of its checkpoint filesystem,
and all take the same decision against the size of the last checkpoint the job committed or resumed (before the
first, the state's tensor bytes). A save that does not fit is skipped, and training goes on."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardstack.train.checkpoint.ranks import Ranks

# One more checkpoint needs its estimated size plus this much: shard sizes drift with the world size and the
# filesystem needs room for its own metadata.
SPACE_MARGIN_RATIO = 0.10
SPACE_MARGIN_BYTES = 64 * 2**20


@dataclass(frozen=True)
class SpaceCheck:
    """The free-space check before a save, as every rank saw it."""

    step: int
    free_bytes: int  # the least any rank's checkpoint filesystem reported
    needed_bytes: int  # the estimated size of one checkpoint plus the margin
    skipped: bool


def free_bytes(path: Path) -> int:
    """Free bytes (for unprivileged writers) on the filesystem `path` is on, or would be on once created."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def state_bytes(state: Any) -> tuple[int, dict[str, int]]:
    """(bytes of this rank's DTensor shards, {key: bytes} of its plain tensors): DCP writes each plain tensor
    once however many ranks hold it under the same key, so those are counted as a union over ranks."""
    sharded, plain = 0, {}
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, DTensor):
            local = value.to_local()
            sharded += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            plain[key] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            stack.extend((f"{key}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{key}.{i}", v) for i, v in enumerate(value))
    return sharded, plain


def check_space(ranks: Ranks, root: Path, step: int, state: Any, *, last_total_bytes: int | None,
                first: bool) -> SpaceCheck:
    """One all-gather, so every rank takes the same decision: the least free space any rank sees against the
    size of the last checkpoint this job committed or resumed (before the first, the state's tensor bytes)."""
    views = ranks.all_gather((free_bytes(root), last_total_bytes, state_bytes(state) if first else None))
    if views[0][1] is not None:  # rank 0 committed or resumed it
        estimate = views[0][1]
    else:
        plain: dict[str, int] = {}
        for *_, (_sharded, local_plain) in views:
            plain.update(local_plain)
        estimate = sum(v[2][0] for v in views) + sum(plain.values())
    needed = int(estimate * (1 + SPACE_MARGIN_RATIO)) + SPACE_MARGIN_BYTES
    free = min(v[0] for v in views)
    return SpaceCheck(step=step, free_bytes=free, needed_bytes=needed, skipped=free < needed)
