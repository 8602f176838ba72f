"""Process-group setup: GPU + NCCL on a node with NVIDIA GPUs, CPU + gloo on one without; under torchrun or alone.

The choice is shardstack.accel's: a node with NVIDIA hardware (PCI vendor 0x10de, /dev/nvidia<N>) whose driver,
torch build or CUDA runtime does not work refuses to start, naming the cause, instead of training on CPU while
torchrun starts one worker per GPU.

Alone (no RANK/WORLD_SIZE in the environment) it still creates a 1-process group on an in-memory store, so FSDP2,
DCP and every collective behave exactly as in a multi-process job.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardstack.accel import decide_device, probe
from shardstack.errors import ShardstackError

log = logging.getLogger("shardstack.dist")

# Seconds a collective may wait before the process group gives up (the training_runtime role renders it into
# train.env). torch's default, 10 minutes, is shorter than a rank can spend in a checkpoint save's collectives while
# another writes 100B-class state to NFS; unset keeps torch's default.
PG_TIMEOUT_ENV = "SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS"


def process_group_timeout() -> timedelta | None:
    """The process group's timeout from the environment, or None (torch's default)."""
    raw = os.environ.get(PG_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = int(raw)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise ShardstackError(f"{PG_TIMEOUT_ENV} is {raw!r}, not a positive number of seconds",
                              hint="set training_runtime_process_group_timeout_seconds to a whole number > 0")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def dp(self, tp: int = 1) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size) with `tp`-way tensor parallelism: the "dp"
        coordinate and size of mesh(tp), whose ranks are laid out row-major (the K ranks of a "tp" group are
        consecutive, so on one node with K GPUs or fewer they share NVLink). All ranks of a "tp" group read the same
        batch."""
        if self.world_size % tp:
            raise ShardstackError(
                f"config key 'engine.tensor_parallel' is {tp}, but the world size ({self.world_size}) is not "
                "divisible by it", hint="start a multiple of engine.tensor_parallel ranks")
        return self.rank // tp, self.world_size // tp

    def mesh(self, tp: int = 1) -> DeviceMesh:
        """A 1-D mesh over all ranks (FSDP2's data-parallel dimension), or with `tp` > 1 a 2-D ("dp", "tp") one."""
        _, dp = self.dp(tp)
        if tp == 1:
            return init_device_mesh(self.device.type, (self.world_size,))
        return init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def _pick_device(prefer: str, local_rank: int) -> tuple[torch.device, str, str]:
    choice = decide_device(probe(), prefer)
    if choice.type == "cpu":
        return torch.device("cpu"), "gloo", choice.why
    if local_rank >= torch.cuda.device_count():
        raise ShardstackError(
            f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()} CUDA device(s)",
            hint="start torchrun with --nproc-per-node equal to the number of GPUs",
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), "nccl", torch.cuda.get_device_name(local_rank)


def _elastic_store_kwargs(rank: int) -> dict:
    """Under torchrun's agent store, a store whose keys are private to this restart attempt.

    With the c10d rendezvous the agent keeps one TCPStore across restarts, and torch's env:// handler adds no
    per-attempt prefix, so restarted workers can read the dead group's gloo addresses ("connectFullMesh failed …
    Connection refused") or its barrier counters (a hang). Prefixing by TORCHELASTIC_RESTART_COUNT, as torch
    itself once did, keeps every attempt's keys apart.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return {}
    from datetime import timedelta

    world_size = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(minutes=10))
    prefixed = dist.PrefixStore(f"/worker/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def init_distributed(device: str = "auto") -> DistInfo:
    """Join (or create) the default process group and pick this rank's device. Idempotent."""
    env = os.environ
    under_launcher = "RANK" in env and "WORLD_SIZE" in env
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", rank))
    dev, backend, what = _pick_device(device, local_rank)
    if not dist.is_initialized():
        timeout = process_group_timeout()
        extra = {"timeout": timeout} if timeout is not None else {}
        if under_launcher:
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None,
                                    **_elastic_store_kwargs(rank), **extra)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    else:
        backend = dist.get_backend()
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                    backend=backend)
    if info.is_main:
        kind = "GPU+NCCL" if backend == "nccl" else "CPU+gloo"
        log.info("shardstack: %s, world size %d, rank 0 on %s (%s)", kind, info.world_size, dev, what)
    return info


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_worker(code: int, *, own_process: bool = False) -> None:
    """End a torchrun worker (or a process of its own) now, without interpreter finalization; called in-process
    outside torchrun, return and let the caller go on.

    Gloo's worker threads release a collective's tensors just after the collective has returned to Python. When
    that release lands in interpreter finalization, the thread cannot take the GIL, unwinds through a noexcept
    destructor and the process aborts (SIGABRT), so torchrun reports a finished job as failed (pytorch#179291);
    a single-process `shardstack train run` aborts the same way. A process whose output is flushed has nothing
    left to finalize.
    """
    if not own_process and "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
