"""This process's place among a job's ranks and the object collectives checkpointing runs over them: broadcast,
gather, all-gather, each a plain local call when there is no process group (a single-process run)."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist


class DistLike(Protocol):
    rank: int
    world_size: int


class Ranks:
    def __init__(self, given: DistLike | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = given.rank if given is not None else (dist.get_rank() if self.distributed else 0)
        self.world_size = given.world_size if given is not None else (
            dist.get_world_size() if self.distributed else 1)

    def broadcast(self, obj: Any, group=None) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def gather(self, obj: Any, group=None) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on every rank (in rank order)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
