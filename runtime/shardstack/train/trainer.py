"""The training loop: a thin driver around the engine, data, metrics and checkpoint components.

Per step it hands the result to the metrics processor (JSON line, log line, Prometheus, MFU) and offers the step to
the checkpointer. After the first step it logs the estimator's per-rank bytes next to the measured local shards.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardstack.errors import ShardstackError
from shardstack.model.decoder import flops_per_token
from shardstack.model.tokenizer import load_tokenizer
from shardstack.train.build import build_on_meta
from shardstack.train.config import JobConfig
from shardstack.train.data import Batches, GlobalSampler, TokenDataset
from shardstack.train.dist import DistInfo, init_distributed
from shardstack.train.engine import Engine, build_engine
from shardstack.train.memory.autobatch import find_micro_batch
from shardstack.train.memory.estimate import estimate_stage
from shardstack.train.memory.host import tune_allocator
from shardstack.train.metrics import MetricsProcessor
from shardstack.train.optim import make_scheduler

log = logging.getLogger("shardstack.trainer")


class TrainState:
    """What a checkpoint holds (torch.distributed.checkpoint Stateful): model/optimizer from the engine, and the rest
    as data that needs no pickle: the torch RNG as a plain uint8 tensor, and step, scheduler, sampler position and
    the numpy/python RNG states as one JSON string (checkpoint/reader.py loads non-tensor items weights-only)."""

    def __init__(self, engine: Engine, scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: GlobalSampler):
        self.engine, self.scheduler, self.sampler = engine, scheduler, sampler
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        sd = self.engine.state_dict()
        # Rank 0's generators (plain values are saved once): with dropout 0, the default, nothing draws from them.
        np_rng = np.random.get_state(legacy=False)
        version, mt, gauss = random.getstate()
        train = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "data": self.sampler.state_dict(),
            "numpy_rng": {**np_rng, "state": {"key": np_rng["state"]["key"].tolist(), "pos": np_rng["state"]["pos"]}},
            "python_rng": [version, list(mt), gauss],
        }
        return {"model": sd["model"], "optimizer": sd["optimizer"], "torch_rng": torch.get_rng_state(),
                "train": json.dumps(train)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.engine.load_state_dict({"model": sd["model"], "optimizer": sd["optimizer"]})
        try:
            train = json.loads(sd["train"])
            step = train["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"step is {step!r}")
            self.scheduler.load_state_dict(train["scheduler"])
            np_rng = train["numpy_rng"]
            np.random.set_state({**np_rng, "state": {**np_rng["state"],
                                                     "key": np.asarray(np_rng["state"]["key"], dtype=np.uint32)}})
            version, mt, gauss = train["python_rng"]
            random.setstate((version, tuple(mt), gauss))
            torch.set_rng_state(sd["torch_rng"])
            self.sampler.load_state_dict(train["data"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ShardstackError(f"the checkpoint's training state is malformed ({exc})") from None
        self.step = step


class StopRequest:
    """SIGTERM or SIGUSR1 during training: finish the step, save a checkpoint, leave cleanly.

    `systemctl stop` (KillMode=mixed: SIGTERM to torchrun, which forwards it to its workers) and `scancel` (SIGTERM
    to every process of the job's steps) both end a job this way. The signal reaches ranks at different moments, so
    after every step the ranks agree with one all-reduce (MAX of a 0/1 flag): all stop after the same step and take
    part in the same checkpoint save. The handler only sets the flag; nothing runs inside it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # signal.signal works in the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal = signum

    def agreed(self) -> bool:
        """True on every rank when any rank has received a stop signal (a collective: every rank calls it)."""
        import torch.distributed as tdist

        flag = torch.tensor([0 if self.signal is None else 1], dtype=torch.int32, device=self.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a signal on another rank"

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    final_step: int = 0
    start_step: int = 0
    tokens_per_second: float = 0.0  # mean over the steps after the first (which pays for warm-up)
    micro_batch: int = 0
    accumulation: int = 0
    memory_measured: dict[str, int] | None = None
    memory_estimated: dict[str, int] | None = None
    stopped_by: str | None = None  # the signal that ended training early (checkpoint saved), else None


def resolve_batch(cfg: JobConfig, world: int, micro: int) -> int:
    """Accumulation steps for `world` data-parallel ranks (with tensor parallelism: world size / K)."""
    per_rank, rem = divmod(cfg.batch.global_batch, world)
    if rem:
        what = "world size" if cfg.engine.tensor_parallel == 1 else "data-parallel size (world / tensor_parallel)"
        raise ShardstackError(f"batch.global_batch ({cfg.batch.global_batch}) is not divisible by the {what} "
                              f"({world})")
    if per_rank % micro:
        raise ShardstackError(f"batch.micro_batch ({micro}) does not divide the per-rank batch ({per_rank})",
                              hint="pick a divisor, or micro_batch: auto")
    accum = per_rank // micro
    if cfg.batch.accumulation is not None and cfg.batch.accumulation != accum:
        raise ShardstackError(
            f"config key 'batch.accumulation' is {cfg.batch.accumulation}, but global_batch {cfg.batch.global_batch}"
            f" / (micro_batch {micro} × world size {world}) = {accum}",
            hint="leave batch.accumulation unset to derive it")
    return accum


def _open_checkpointer(cfg: JobConfig, dist_info: DistInfo):
    if not cfg.checkpoint.dir:
        return None
    if cfg.name is None:  # checkpoints belong to a job: without a name this job could resume anyone's
        raise ShardstackError("config key 'name' is not set, and checkpoints record the job they belong to",
                              hint="set name: <job> in the job config (`shardstack train run` uses the config "
                                   "file's stem)")
    from shardstack.train.checkpoint.checkpointer import Checkpointer

    return Checkpointer(cfg.checkpoint, config_hash=cfg.config_hash(), job=cfg.name, dist=dist_info,
                        stage=cfg.engine.stage, job_config=cfg.to_dict())


def train(cfg: JobConfig, max_steps: int | None = None, *, out=None) -> TrainResult:
    """Train until schedule.total_steps (or `max_steps` more steps). Works alone or under torchrun."""
    out = out or sys.stdout
    info = init_distributed(cfg.engine.device)
    cfg = cfg.for_device(info.device.type)  # what the log, autobatch and the checkpointer say
    if info.device.type == "cpu":
        # FSDP frees and re-allocates every block's gathered weights each step; glibc's adaptive mmap threshold would
        # keep those buffers in a heap that never shrinks, and the RSS would creep past what the shards need.
        tune_allocator()
    # The ranks of one tensor-parallel group compute one data-parallel rank's step together: same batch, same draws.
    dp_rank, dp_size = info.dp(cfg.engine.tensor_parallel)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    # No rank ever holds the whole model: build on meta, shard, then materialise the local shards (build_engine).
    model, materialize = build_on_meta(cfg.model, cfg.seed)
    seq_len = model.config.seq_len
    if not cfg.data.path:
        raise ShardstackError("config key 'data.path' is not set",
                              hint="run `shardstack data prepare --out DIR` and set data.path: DIR")
    dataset = TokenDataset(cfg.data.path, seq_len)
    model_vocab = model.config.vocab_size
    if dataset.vocab_size > model_vocab:
        raise ShardstackError(f"data vocabulary ({dataset.vocab_size}) exceeds model.vocab_size ({model_vocab})")
    if cfg.data.tokenizer is not None and dataset.meta["tokenizer"] != load_tokenizer(cfg.data.tokenizer).name:
        raise ShardstackError(f"{cfg.data.path} was prepared with tokenizer {dataset.meta['tokenizer']}, but "
                              f"data.tokenizer is {cfg.data.tokenizer}",
                              hint=f"prepare it again: shardstack data prepare --tokenizer {cfg.data.tokenizer}")
    flops = flops_per_token(model)

    engine = build_engine(model, cfg.engine, cfg.optimizer, info, materialize=materialize)
    if cfg.batch.micro_batch == "auto":
        micro = find_micro_batch(cfg, engine, seq_len, model_vocab)
    else:
        micro = cfg.batch.micro_batch
    accum = resolve_batch(cfg, dp_size, micro)
    torch.manual_seed(cfg.seed + dp_rank)  # per-data-parallel-rank streams from here on (dropout)

    sampler = GlobalSampler(len(dataset), global_batch=cfg.batch.global_batch, world_size=dp_size,
                            rank=dp_rank, seed=cfg.seed, shuffle=cfg.data.shuffle)
    batches = Batches(dataset, sampler, micro, info.device)
    scheduler = make_scheduler(engine.optimizer, cfg.schedule)
    state = TrainState(engine, scheduler, sampler)
    ckpt = _open_checkpointer(cfg, info)
    start = ckpt.resume(state) if ckpt else 0
    state.step = start
    total = cfg.schedule.total_steps
    end = total if max_steps is None else min(total, start + max_steps)

    tokens_per_step = cfg.batch.global_batch * seq_len
    metrics = MetricsProcessor(cfg.metrics, is_main=info.is_main, device=info.device, world_size=info.world_size,
                               tokens_per_step=tokens_per_step, flops_per_token=flops, out=out)
    if ckpt:
        ckpt.on_space_check = lambda c: metrics.checkpoint_space(free_bytes=c.free_bytes, skipped=c.skipped)
        ckpt.on_commit = metrics.checkpoint_committed
        if start:
            metrics.checkpoint_committed(start)
    if info.is_main:
        log.info("stage %d, precision %s, offload %s, global batch %d = micro %d × accumulation %d × dp %d; "
                 "steps %d→%d; MFU against %.1f TFLOP/s per device (%s)", engine.stage, cfg.engine.precision,
                 cfg.engine.offload, cfg.batch.global_batch, micro, accum, dp_size, start, end, metrics.peak,
                 metrics.peak_source)
        if cfg.engine.tensor_parallel > 1:
            log.info("tensor parallel: a %d (dp) × %d (tp) mesh", dp_size, cfg.engine.tensor_parallel)
    result = TrainResult(start_step=start, final_step=start, micro_batch=micro, accumulation=accum)
    rates: list[float] = []
    stop = StopRequest(info.device)
    try:
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()
            loss = engine.forward_backward(batches.next_step())
            stats = engine.step(measure=step == start + 1)
            scheduler.step()
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            state.step = step
            tps = metrics.record(step=step, end=end, loss=loss, seconds=time.perf_counter() - t0,
                                 lr=scheduler.get_last_lr()[0], grad_norm=stats.grad_norm, skipped=stats.skipped)
            if step > start + 1:
                rates.append(tps)
            result.steps.append(step)
            result.losses.append(loss)
            result.final_step = step
            if step == start + 1:
                _log_memory(cfg, engine, micro, seq_len, accum, result)
            if ckpt:
                ckpt.maybe_save(step, state)
            if step < end and stop.agreed():
                result.stopped_by = stop.name
                if info.is_main:
                    log.warning("stopping after step %d on %s: saving a checkpoint, then leaving (a resubmitted or "
                                "requeued job resumes from it)", step, stop.name)
                break
        if ckpt:
            ckpt.finish(state.step, state)
    finally:
        stop.restore()
        metrics.close()
    result.tokens_per_second = sum(rates) / len(rates) if rates else 0.0
    return result


def _log_memory(cfg: JobConfig, engine: Engine, micro: int, seq_len: int, accum: int, result: TrainResult) -> None:
    measured = engine.last_memory or engine.memory_breakdown()
    est = estimate_stage(engine.module, engine.cfg, engine.stage, engine.dist.world_size, engine.dist.rank,
                         weight_decay=cfg.optimizer.weight_decay, micro_batch=micro, seq_len=seq_len,
                         accumulation=accum, optimizer_impl=cfg.optimizer.impl)
    result.memory_measured = measured
    result.memory_estimated = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                               "total": est.total, "peak": est.peak}
    if engine.dist.is_main:
        log.info("memory rank 0 (params+grads+optimizer): estimated %.2f MiB, measured %.2f MiB (ratio %.3f); "
                 "estimated device peak in a step %.2f MiB", est.total / 2**20, measured["total"] / 2**20,
                 measured["total"] / est.total if est.total else float("nan"), est.peak / 2**20)
