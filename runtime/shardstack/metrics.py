"""Training metrics: Prometheus gauges served by rank 0, and the peak FLOP/s that MFU is measured against."""

from __future__ import annotations

import logging
import time

import torch
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from shardstack.errors import ShardstackError

log = logging.getLogger("shardstack.metrics")

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' datasheets; matched on the device name.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


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
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"{name} bf16 dense datasheet"
        raise ShardstackError(f"no known peak FLOP/s for {name}", hint="set metrics.peak_tflops")
    return _cpu_matmul_tflops(), f"measured CPU fp32 matmul ({torch.get_num_threads()} threads)"


class TrainMetrics:
    """The gauges of DESIGN.md §5 on their own registry (so tests can run several trainers in one process)."""

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

    def update(self, *, step: int, loss: float, step_seconds: float, tokens_per_second: float, mfu: float) -> None:
        self.step.set(step)
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
