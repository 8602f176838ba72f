"""`batch.micro_batch: auto`: the largest micro-batch that fits on every rank, keeping the global batch via
accumulation (design: docs/runtime.md, "micro_batch: auto").

Candidates are the divisors of the per-rank batch, largest first. Every rank tries the same candidate and the
ranks agree on its outcome in one all-reduce(MAX) per candidate. The trial contains no collective, so every rank
reaches that all-reduce whatever happened to it: an out-of-memory inside the engine's own step (FSDP2 all-gathers in
forward and reduce-scatters in backward, DDP all-reduces in backward) would leave the other ranks waiting in a
collective the failed rank never joins. The trial is a local replica of the step instead:

- the model built unsharded in the step's compute precision, its block list one block repeated L times (L blocks'
  activations, one block's weights), on this rank's device, recomputing in backward the blocks the engine's
  activation checkpointing recomputes;
- a reservation of what the real step holds besides activations and the replica does not (the estimator's peak
  without activations, less what this rank already holds and the replica's weights and gradients);
- one forward/backward at the candidate size.

Out of memory marks the candidate failed on this rank: a CUDA OOM on GPU; on CPU, where the kernel's OOM killer
does not raise, an allocation refused under RLIMIT_DATA set to the rank's budget for the trial. Any other error is
agreed on too and then raised on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import resource
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardstack.errors import ShardstackError
from shardstack.model.spec import build_model
from shardstack.train.config import JobConfig
from shardstack.train.engine import Engine
from shardstack.train.memory.estimate import estimate_stage
from shardstack.train.parallelize import checkpointed_blocks, shard_units

log = logging.getLogger("shardstack.autobatch")

OK, OUT_OF_MEMORY, ERROR = 0, 1, 2
# Of a GPU's memory, what the trial may use: the rest is left to NCCL's buffers and the allocator's fragmentation.
CUDA_TRIAL_FRACTION = 0.95


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def cpu_budget_bytes(cfg: JobConfig) -> int:
    """The configured budget, else half of MemAvailable shared by the ranks on this node."""
    if cfg.batch.cpu_memory_budget_mb:
        return cfg.batch.cpu_memory_budget_mb * 2**20
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return avail // 2 // local_world


class Recomputed(nn.Module):
    """A place in the replica's block list whose activations are recomputed in backward, as the engine's
    checkpointed blocks are (the shared block itself cannot carry a per-place forward)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def replica(cfg: JobConfig, engine: Engine) -> nn.Module:
    """The model unsharded on this rank's device, one block standing in for all L (no collective ever runs on it),
    with engine.activation_checkpointing applied to the same places."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    blocks = shard_units(model)
    recompute = set(checkpointed_blocks(len(blocks), cfg.engine.activation_checkpointing,
                                        cfg.engine.activation_checkpointing_every))
    model.blocks = nn.ModuleList([Recomputed(blocks[0]) if i in recompute else blocks[0] for i in range(len(blocks))])
    # FSDP2 stages compute in the compute dtype (MixedPrecisionPolicy); DDP stages autocast fp32 weights.
    dtype = engine.compute_dtype if engine.stage >= 2 else torch.float32
    model = model.to(dtype=dtype).to_empty(device=engine.dist.device)
    with torch.no_grad():
        for p in model.parameters():  # values do not matter for memory; garbage could hold denormals (slow on CPU)
            p.normal_(0.0, 0.02)
    return model


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _held_bytes(engine: Engine) -> int:
    if engine.dist.device.type == "cuda":
        return torch.cuda.memory_allocated(engine.dist.device)
    return engine.memory_breakdown()["total"]


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise ShardstackError("no VmData in /proc/self/status: the CPU trial's memory limit needs Linux")


# glibc's mallopt(M_MMAP_THRESHOLD): allocations at least this large are mmap'd and returned to the kernel when freed.
_M_MMAP_THRESHOLD, _MMAP_THRESHOLD = -3, 128 << 10


def _fixed_mmap_threshold() -> None:
    """By default glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which tensors
    are served from heap that an earlier trial left free: VmData would not grow and the limit would not bite. A fixed
    threshold keeps every tensor-sized block an mmap of its own, so VmData follows what is live."""
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


@contextlib.contextmanager
def _memory_limit(device: torch.device, allowance: int | None) -> Iterator[None]:
    """CPU: refuse allocations beyond `allowance` more bytes (RLIMIT_DATA); CUDA: cap the caching allocator."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(CUDA_TRIAL_FRACTION, device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    assert allowance is not None
    _fixed_mmap_threshold()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data() + max(0, allowance)
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _out_of_memory(exc: BaseException) -> bool:
    # CPU allocation failures surface as RuntimeError from c10's DefaultCPUAllocator ("can't allocate memory").
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def trial(model: nn.Module, engine: Engine, micro_batch: int, seq_len: int, vocab: int, reserve: int,
          allowance: int | None) -> tuple[int, str]:
    """One local forward/backward of the replica at `micro_batch` under this rank's limit → (OK | OUT_OF_MEMORY |
    ERROR, what happened). Never raises and never communicates."""
    dev = engine.dist.device
    autocast = contextlib.nullcontext() if engine.stage >= 2 or engine.compute_dtype == torch.float32 else \
        torch.autocast(dev.type, dtype=engine.compute_dtype)
    gen = torch.Generator(device=dev).manual_seed(micro_batch)
    held: list[torch.Tensor] = []
    try:
        with _memory_limit(dev, allowance):
            held.append(torch.empty(reserve, dtype=torch.uint8, device=dev))
            x = torch.randint(0, vocab, (micro_batch, seq_len), device=dev, generator=gen)
            with autocast:
                loss = model(x, x)
            loss.backward()
        return OK, "fits"
    except Exception as exc:
        return (OUT_OF_MEMORY if _out_of_memory(exc) else ERROR), f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        held.clear()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def try_micro_batch(cfg: JobConfig, engine: Engine, model: nn.Module, micro_batch: int, seq_len: int, vocab: int,
                    budget: int | None) -> tuple[int, str]:
    """This rank's trial of one candidate with the reservation the estimator gives for it (see the module doc)."""
    info = engine.dist
    per_rank = cfg.batch.global_batch // info.world_size
    est = estimate_stage(engine.module, engine.cfg, engine.stage, info.world_size, info.rank,
                         weight_decay=cfg.optimizer.weight_decay, micro_batch=micro_batch, seq_len=seq_len,
                         accumulation=per_rank // micro_batch, optimizer_impl=cfg.optimizer.impl)
    held = _held_bytes(engine)
    stand_in = 2 * _nbytes(model)  # the replica's weights and gradients are part of the step's own working set
    reserve = max(0, est.peak - est.activations - held - stand_in)
    allowance = None if budget is None else budget - held
    return trial(model, engine, micro_batch, seq_len, vocab, reserve, allowance)


def find_micro_batch(cfg: JobConfig, engine: Engine, seq_len: int, vocab: int, *, budget: int | None = None) -> int:
    """The largest divisor of the per-rank batch whose trial fits on every rank. `budget` (CPU: bytes the step may
    hold on this rank) defaults to cpu_budget_bytes(cfg); on GPU the device's memory is the budget."""
    info = engine.dist
    per_rank = cfg.batch.global_batch // info.world_size
    on_gpu = info.device.type == "cuda"
    if not on_gpu and budget is None:
        budget = cpu_budget_bytes(cfg)
    model = replica(cfg, engine)
    chosen = None
    for mb in divisors_desc(per_rank):
        code, what = try_micro_batch(cfg, engine, model, mb, seq_len, vocab, None if on_gpu else budget)
        if code != OK:
            log.info("rank %d: micro-batch %d: %s", info.rank, mb, what)
        agreed = torch.tensor(code, device=info.device)
        if info.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the one collective per candidate, reached by every rank
        if int(agreed) == ERROR:
            raise ShardstackError(f"micro_batch auto: the trial of micro-batch {mb} failed"
                                  + (f" here: {what}" if code == ERROR else " on another rank (see its log)"),
                                  hint="set batch.micro_batch to a number")
        if int(agreed) == OK:
            chosen = mb
            break
        if info.is_main:
            log.info("micro-batch %d does not fit on some rank; backing off", mb)
    del model
    if chosen is None:
        where = f"{torch.cuda.get_device_properties(info.device).total_memory / 2**20:.0f} MiB of GPU memory" \
            if on_gpu else f"the memory budget ({(budget or 0) / 2**20:.0f} MiB per rank)"
        raise ShardstackError(f"not even micro_batch 1 fits {where}",
                              hint="raise batch.cpu_memory_budget_mb, use a higher engine.stage, or a smaller model")
    how = "largest whose trial ran without running out of memory on every rank"
    if not on_gpu:
        how += f"; CPU budget {(budget or 0) / 2**20:.0f} MiB on rank {info.rank}"
    log.info("micro_batch auto: %d (%s), accumulation %d", chosen, how, per_rank // chosen)
    return chosen
