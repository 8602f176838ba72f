"""Training metrics: one processor that reports every finished step (a JSON line, a log line, Prometheus gauges
served by rank 0, MFU against a stated peak FLOP/s)."""

from __future__ import annotations

import json
import logging
import re
import resource
import sys
import time
from typing import IO, Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shardstack.errors import ShardstackError
from shardstack.train.config import MetricsConfig

log = logging.getLogger("shardstack.metrics")

# Dense bf16 tensor-core peaks per GPU (TFLOP/s, no sparsity: half the datasheets' headline figures), matched on
# torch's device name; the first pattern that matches wins, so a form factor (PCIe, NVL) comes before its SXM part.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2500.0),
    (r"\bB200\b", 2250.0),
    (r"\bB100\b", 1750.0),
    (r"\bH[12]00 NVL\b", 835.0),
    (r"\bH100 PCIe\b", 756.0),
    (r"\bG?H[12]00\b|\bH800\b", 989.0),  # SXM: "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB"
    (r"\bA[18]00\b", 312.0),  # SXM and PCIe alike
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10G\b", 70.0),
)


def gpu_peak_tflops(name: str) -> float | None:
    """The table's dense bf16 peak for a device name, None for a GPU it does not know."""
    return next((value for pattern, value in GPU_PEAK_TFLOPS if re.search(pattern, name)), None)


def _cpu_matmul_tflops(n: int = 512, seconds: float = 0.3) -> float:
    """Measured fp32 GEMM throughput of this process's threads: the CPU has no datasheet figure we can trust."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def peak_tflops(device: torch.device, configured: float | None) -> tuple[float, str]:
    """(peak TFLOP/s per device, where the figure comes from)."""
    if configured:
        return configured, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if (value := gpu_peak_tflops(name)) is not None:
            return value, f"{name} bf16 dense datasheet"
        raise ShardstackError(f"no known peak FLOP/s for {name!r}: MFU needs the GPU's dense bf16 peak",
                              hint="set metrics.peak_tflops in the job config to the datasheet's dense (not sparse) "
                                   "bf16 TFLOP/s of one GPU")
    return _cpu_matmul_tflops(), f"measured CPU fp32 matmul ({torch.get_num_threads()} threads)"


class TrainMetrics:
    """The training gauges (docs/monitoring.md) on their own registry, so tests can run several trainers in one
    process."""

    def __init__(self, port: int | None, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tokens_per_second = Gauge("shardstack_train_tokens_per_second", "Training throughput, all ranks",
                                       registry=r)
        self.step_seconds = Gauge("shardstack_train_step_seconds", "Wall time of the last optimizer step", registry=r)
        self.mfu = Gauge("shardstack_train_mfu_ratio", "Model FLOPs utilisation against the stated peak", registry=r)
        self.loss = Gauge("shardstack_train_loss", "Training loss of the last step (mean over ranks)", registry=r)
        self.last_step_ts = Gauge("shardstack_train_last_step_timestamp_seconds",
                                  "Unix time at which the last step finished", registry=r)
        self.step = Gauge("shardstack_train_step", "Last finished optimizer step", registry=r)
        self.end_step = Gauge("shardstack_train_end_step", "The step this run ends at (schedule.total_steps, or "
                              "the start plus --max-steps)", registry=r)
        self.last_checkpoint_step = Gauge("shardstack_train_last_checkpoint_step",
                                          "Step of the newest committed checkpoint (resumed from or saved)",
                                          registry=r)
        self.checkpoint_skipped = Counter("shardstack_train_checkpoint_skipped", "Checkpoint saves skipped because "
                                          "the checkpoint filesystem lacked the space for one more", registry=r)
        self.checkpoint_free_bytes = Gauge("shardstack_train_checkpoint_free_bytes",
                                           "Free bytes on the checkpoint filesystem at the last save", registry=r)
        self._server = None
        if port:
            try:
                self._server, _thread = start_http_server(port, addr=addr, registry=r)
            except OSError as exc:
                raise ShardstackError(f"cannot serve metrics on port {port}: {exc.strerror}",
                                      hint="set metrics.port to a free port, or 0 to turn metrics off") from None
            log.info("metrics on http://%s:%d/metrics", addr, port)

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def update(self, *, step: int, end: int, loss: float, step_seconds: float, tokens_per_second: float,
               mfu: float) -> None:
        self.step.set(step)
        self.end_step.set(end)
        self.loss.set(loss)
        self.step_seconds.set(step_seconds)
        self.tokens_per_second.set(tokens_per_second)
        self.mfu.set(mfu)
        self.last_step_ts.set(time.time())

    def close(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def resident_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocated device memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsProcessor:
    """Everything a finished step reports, in one place: one JSON line on stdout (and `metrics.json_log`), a
    progress line on the log, the Prometheus gauges and MFU = FLOPs/token × tokens/s ÷ (peak × world size).
    Only rank 0 reports; on the other ranks `record` just returns the step's tokens/s."""

    def __init__(self, cfg: MetricsConfig, *, is_main: bool, device: torch.device, world_size: int,
                 tokens_per_step: int, flops_per_token: float, out: IO[str] | None = None) -> None:
        self.cfg, self.is_main, self.device, self.world_size = cfg, is_main, device, world_size
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.out = out or sys.stdout
        self.peak, self.peak_source = peak_tflops(device, cfg.peak_tflops) if is_main else (0.0, "")
        self.gauges = TrainMetrics(cfg.port) if is_main and cfg.port else None
        self.json_log = open(cfg.json_log, "a") if is_main and cfg.json_log else None  # noqa: SIM115

    def record(self, *, step: int, end: int, loss: float, seconds: float, lr: float, grad_norm: float | None,
               skipped: bool) -> float:
        tps = self.tokens_per_step / seconds
        if not self.is_main:
            return tps
        mfu = self.flops_per_token * tps / (self.peak * 1e12 * self.world_size)
        if self.gauges:
            self.gauges.update(step=step, end=end, loss=loss, step_seconds=seconds, tokens_per_second=tps, mfu=mfu)
        if step % self.cfg.log_every == 0 or step == end:
            rec: dict[str, Any] = {
                "step": step, "loss": round(loss, 6), "lr": lr, "tokens_per_second": round(tps, 1),
                "step_seconds": round(seconds, 4), "mfu": round(mfu, 5), "peak_tflops_per_device": round(self.peak, 3),
                "grad_norm": None if grad_norm is None else round(grad_norm, 5), "skipped": skipped,
                "memory_bytes": resident_bytes(self.device)}
            line = json.dumps(rec)
            print(line, file=self.out, flush=True)
            if self.json_log:
                self.json_log.write(line + "\n")
                self.json_log.flush()
            log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s %.3fs/step MFU %.2f%%", step, end, loss, lr, tps,
                     seconds, 100 * mfu)
        return tps

    def checkpoint_space(self, *, free_bytes: int, skipped: bool) -> None:
        """The checkpointer's free-space check before a save (every rank calls it; rank 0 exports it)."""
        if self.gauges:
            self.gauges.checkpoint_free_bytes.set(free_bytes)
            if skipped:
                self.gauges.checkpoint_skipped.inc()

    def checkpoint_committed(self, step: int) -> None:
        """A checkpoint of `step` is committed (or was resumed from); rank 0 exports its step."""
        if self.gauges:
            self.gauges.last_checkpoint_step.set(step)

    def close(self) -> None:
        if self.gauges:
            self.gauges.close()
        if self.json_log:
            self.json_log.close()
