"""Seeded initialisation that gives the same weights at every world size, stage and sharding.

Every parameter is a function of (seed, its FQN) only: its rows are cut into fixed chunks of about CHUNK_ELEMENTS
elements (the cut depends on the global shape alone), and chunk c is drawn by the model's `init_param` from a
generator seeded with hash(seed, FQN, c). A rank that holds rows [a, b) of a tensor — a DTensor shard from FSDP2,
or a whole tensor for DDP — draws only the chunks that overlap them and keeps its rows, so no rank ever materialises
a full tensor it does not own, and any sharding sees the same values. Generators are per chunk rather than one
generator advanced to an offset because torch's CPU and CUDA generators have no cheap, portable "skip ahead".

The hook a model provides (shardstack.model.spec.ShardedModel: GPT and Llama do; build_model checks a
`model.factory` model has it, see docs/runtime.md):

    def init_param(self, name: str, rows: torch.Tensor, generator: torch.Generator) -> None:
        '''Fill `rows` in place: a block of whole dim-0 rows of parameter `name` (its FQN in the model), shape
        [r, *param.shape[1:]], drawing from `generator` only, element by element (i.i.d., so any cut of the rows
        gives the same values).'''
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardstack.model.spec import ShardedModel

CHUNK_ELEMENTS = 1 << 20  # ~4 MiB of fp32 per draw: bounds the scratch memory of initialising any tensor


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed, the same in every process


def _local_block(p: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The tensor this rank holds for parameter `p` and its offset in the global tensor, per dimension."""
    if isinstance(p, DTensor):
        # DTensor's chunk list (the protocol DCP uses) gives the global offset of the local shard for any placement.
        return p.to_local(), list(p.__create_chunk_list__()[0].offsets)
    return p, [0] * p.dim()


def to_empty(model: nn.Module, device: torch.device | str) -> None:
    """`model.to_empty(device=...)` keeping tied parameters tied: plain to_empty gives each module its own copy of a
    shared parameter (FSDP2's keeps the parameter objects, so there this re-ties nothing)."""
    owners: dict[int, str] = {}
    ties: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners:
            ties.append((name, owners[id(p)]))
        else:
            owners[id(p)] = name
    model.to_empty(device=device)
    for name, source in ties:
        module, _, attr = name.rpartition(".")
        shared = model.get_parameter(source)
        if model.get_parameter(name) is not shared:
            setattr(model.get_submodule(module), attr, shared)


@torch.no_grad()
def init_parameters(model: ShardedModel, seed: int) -> None:
    """Fill every parameter of `model` (whole tensors, or this rank's DTensor shards) from (seed, FQN)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        local, offset = _local_block(p)
        if local.is_meta or local.numel() == 0:
            continue
        if local.device not in generators:
            generators[local.device] = torch.Generator(local.device)
        gen = generators[local.device]
        if p.dim() == 0:
            gen.manual_seed(chunk_seed(seed, name, 0))
            model.init_param(name, local.view(1), gen)
            continue
        row = math.prod(p.shape[1:])
        per_chunk = max(1, CHUNK_ELEMENTS // max(1, row))
        first, stop = offset[0], offset[0] + local.shape[0]
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
        for c in range(first // per_chunk, math.ceil(stop / per_chunk)):
            lo, hi = c * per_chunk, min((c + 1) * per_chunk, p.shape[0])
            rows = torch.empty((hi - lo, *p.shape[1:]), dtype=local.dtype, device=local.device)
            gen.manual_seed(chunk_seed(seed, name, c))
            model.init_param(name, rows, gen)
            a, b = max(lo, first), min(hi, stop)
            local[a - first: b - first].copy_(rows[(slice(a - lo, b - lo), *cols)])
