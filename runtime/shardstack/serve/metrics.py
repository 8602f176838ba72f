"""Prometheus metrics of the inference service (names in docs/monitoring.md), on a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """Hooks the engine calls; the default does nothing (the app plugs Prometheus in)."""

    def queue_depth(self, running: int, waiting: int) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def step(self, batch: int) -> None: ...


class ServeMetrics(EngineMetrics):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "shardstack_infer_request_duration_seconds",
            "Time from receiving a completion request to its last byte, successful requests",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "shardstack_infer_time_to_first_token_seconds",
            "Time from admission request to the first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("shardstack_infer_requests_running", "Requests holding a KV-cache slot", registry=r)
        self.waiting = Gauge("shardstack_infer_requests_waiting", "Admitted requests waiting for a slot", registry=r)
        self.requests = Counter("shardstack_infer_requests",
                                "Completion API responses by HTTP status code and named API key (- for none)",
                                ["code", "api_key"], registry=r)
        self.prompt_tokens = Counter("shardstack_infer_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("shardstack_infer_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("shardstack_infer_engine_steps", "Engine loop iterations that ran the model",
                             registry=r)
        self.batch = Histogram("shardstack_infer_batch_size", "Requests per engine step", buckets=_BATCH_BUCKETS,
                               registry=r)
        self.heartbeat = Gauge("shardstack_infer_engine_heartbeat_timestamp_seconds",
                               "Unix time of the engine loop's last iteration (stale = hung loop)", registry=r)
        self.ready = Gauge("shardstack_infer_ready", "1 when the model is loaded, warmed up and admitting",
                           registry=r)

    def bind_heartbeat(self, wall_clock: Callable[[], float]) -> None:
        self.heartbeat.set_function(wall_clock)

    # EngineMetrics hooks, called from the engine thread (prometheus_client is thread-safe).
    def queue_depth(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def step(self, batch: int) -> None:
        self.steps.inc()
        self.batch.observe(batch)
