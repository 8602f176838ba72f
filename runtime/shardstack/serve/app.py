"""The HTTP side: Starlette routes over one `Engine`, with admission control, auth, health and metrics.

Lifecycle (`Service.phase`): loading → ready → draining, or loading → failed. The model loads on a
background thread so `/health` can answer 503 while it does; READY=1 goes to systemd once the model is
warmed up *and* the server listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardstack import __version__
from shardstack.serve.engine import Engine, Event, QueueFull, Sequence
from shardstack.serve.metrics import ServeMetrics
from shardstack.serve.notify import Notifier
from shardstack.serve.protocol import ApiError, CompletionRequest, Limits, invalid, parse_completion
from shardstack.serve.sampling import SamplingParams
from shardstack.serve.text import decode, utf8_stream_decoder

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ServeSettings:
    model_dir: Path
    model_name: str | None = None  # default: the model directory's name
    max_concurrency: int = 16  # requests decoded together = KV-cache slots; 1 turns batching off
    max_queue: int = 64  # admitted requests waiting for a slot; beyond that: 429
    max_tokens: int | None = None  # per-request ceiling; default: the model context
    max_body_bytes: int = 1 << 20
    max_prefill_tokens: int = 4096  # padded tokens per prefill batch; bounds the stall it causes to decoding
    token: str | None = None  # bearer token for /v1/* and /info; None = open
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32) | float32 | bfloat16 | float16
    stall_seconds: float = 30.0  # /health turns 503 when the engine loop has not iterated for this long
    drain_seconds: float = 30.0  # on SIGTERM, how long in-flight requests get before they are aborted
    failpoint: str | None = None  # test-only fault injection, see engine.FAILPOINT_HANG
    extra_info: dict[str, Any] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


class Handoff:
    """Delivers engine events (engine thread) to per-request asyncio queues (event loop).

    The first event of a burst schedules one drain on the loop; the rest of the step's events ride along, so
    the loop wakes once per engine step rather than once per request per token.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue[Event], Event]] = []
        self._lock = threading.Lock()

    def to(self, queue: asyncio.Queue[Event]) -> Callable[[Event], None]:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return lambda ev: self._push(queue, ev)

    def _push(self, queue: asyncio.Queue[Event], ev: Event) -> None:
        with self._lock:
            self._pending.append((queue, ev))
            first = len(self._pending) == 1
        if first:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, ev in pending:
            queue.put_nowait(ev)


class Service:
    """Owns the engine and everything the routes need to decide what to answer."""

    def __init__(self, settings: ServeSettings, notifier: Notifier | None = None) -> None:
        self.settings = settings
        self.name = settings.model_name or settings.model_dir.resolve().name
        self.notifier = notifier or Notifier()
        self.metrics = ServeMetrics()
        self.phase = "loading"
        self.failure: str | None = None
        self.engine: Engine | None = None
        self.meta: dict[str, Any] = {}
        self.limits: Limits | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.on_failure: Callable[[], None] = lambda: None  # the server sets this to stop itself
        self.handoff = Handoff()
        self._listening = False
        self._lock = threading.Lock()
        self._ready_sent = False
        self._loader = threading.Thread(target=self._load, name="shardstack-loader", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        self.notifier.status("loading model")
        self._loader.start()

    def _load(self) -> None:
        from shardstack.export import load_model

        s = self.settings
        started = time.monotonic()
        try:
            self.device = resolve_device(s.device)
            self.dtype = resolve_dtype(s.dtype, self.device)
            model, meta = load_model(s.model_dir, self.device, self.dtype)
            model.eval()
            context = model.config.seq_len
            self.limits = Limits(context=context, max_tokens=min(s.max_tokens or context, context - 1))
            engine = Engine(model, max_batch=s.max_concurrency, max_queue=s.max_queue, device=self.device,
                            dtype=self.dtype, max_prefill_tokens=s.max_prefill_tokens, metrics=self.metrics,
                            failpoint=s.failpoint)
            self.metrics.bind_heartbeat(lambda: engine.heartbeat_wall)
            engine.start()
            self.engine, self.meta = engine, meta
            # Warm-up: prefill and decode once so the first client does not pay for allocator and kernel setup.
            prompt = list(b"warm up")[: max(1, context // 2)]
            engine.generate(prompt, max(1, min(4, context - len(prompt))), SamplingParams(seed=0), internal=True)
        except Exception as exc:
            log.exception("loading the model from %s failed", s.model_dir)
            self.failure = f"{type(exc).__name__}: {exc}"
            self.phase = "failed"
            self.notifier.status(f"failed: {self.failure}")
            self.on_failure()
            return
        log.info("model %s loaded and warmed up in %.1fs on %s (%s): %d params, context %d, %d slots",
                 self.name, time.monotonic() - started, self.device, str(self.dtype).removeprefix("torch."),
                 model.num_params(), context, s.max_concurrency)
        with self._lock:
            if self.phase == "loading":
                self.phase = "ready"
                self.metrics.ready.set(1)
        self._maybe_ready()

    def mark_listening(self) -> None:
        self._listening = True
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        with self._lock:
            if self._ready_sent or self.phase != "ready" or not self._listening:
                return
            self._ready_sent = True
        self.notifier.ready(f"serving {self.name}")

    def begin_drain(self) -> bool:
        """Stop admitting. Returns False if already draining."""
        with self._lock:
            if self.phase == "draining":
                return False
            self.phase = "draining"
            self.metrics.ready.set(0)
        self.notifier.stopping("draining")
        return True

    def shutdown(self) -> None:
        if self.engine:
            self.engine.stop()

    # ---- state the routes read ----------------------------------------------------------------------------
    def stalled(self) -> float | None:
        """Heartbeat age if the engine loop has not iterated within the bound, else None."""
        if self.engine is None:
            return None
        age = self.engine.heartbeat_age()
        return age if age > self.settings.stall_seconds else None

    def alive(self) -> bool:
        """Whether to feed the systemd watchdog: loading is progress; afterwards the engine loop must be."""
        if self.phase == "loading":
            return self._loader.is_alive()
        return self.engine is not None and self.stalled() is None

    def authorize(self, request: Request) -> None:
        token = self.settings.token
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(401, "missing or invalid bearer token", "authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})

    def admitting_engine(self) -> Engine:
        if self.phase == "draining":
            raise ApiError(503, "server is draining; retry on another replica", "unavailable",
                           headers={"Retry-After": "1"})
        if self.phase != "ready" or self.engine is None:
            raise ApiError(503, f"server is {self.phase}", "unavailable", headers={"Retry-After": "5"})
        age = self.stalled()
        if age is not None:
            raise ApiError(503, f"engine loop has made no progress for {age:.0f}s", "unavailable")
        return self.engine


# ---- routes -----------------------------------------------------------------------------------------------
def _service(request: Request) -> Service:
    return request.app.state.service


async def health(request: Request) -> JSONResponse:
    svc = _service(request)
    if svc.phase != "ready":
        body: dict[str, Any] = {"status": svc.phase}
        if svc.failure:
            body["error"] = svc.failure
        return JSONResponse(body, status_code=503)
    age = svc.stalled()
    if age is not None:
        return JSONResponse({"status": "stalled", "heartbeat_age_seconds": round(age, 3)}, status_code=503)
    assert svc.engine is not None
    running, waiting = svc.engine.counts()
    return JSONResponse({"status": "ok", "running": running, "waiting": waiting})


async def info(request: Request) -> JSONResponse:
    svc = _service(request)
    svc.authorize(request)
    s = svc.settings
    body: dict[str, Any] = {
        "model": svc.name,
        "model_dir": str(s.model_dir),
        "phase": svc.phase,
        "version": __version__,
        "tokenizer": "bytes",
        "checkpoint": svc.meta.get("source_checkpoint"),
        "step": svc.meta.get("step"),
        "dtype": str(svc.dtype).removeprefix("torch.") if svc.dtype else None,
        "device": str(svc.device) if svc.device else None,
        "limits": {
            "max_concurrency": s.max_concurrency,
            "max_queue": s.max_queue,
            "max_tokens": svc.limits.max_tokens if svc.limits else None,
            "context": svc.limits.context if svc.limits else None,
            "max_body_bytes": s.max_body_bytes,
        },
        **s.extra_info,
    }
    if svc.engine is not None:
        body["model_config"] = svc.engine.config.to_dict()
    return JSONResponse(body)


async def models(request: Request) -> JSONResponse:
    svc = _service(request)
    svc.authorize(request)
    return JSONResponse({"object": "list", "data": [{"id": svc.name, "object": "model", "owned_by": "shardstack"}]})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_service(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes", "payload_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", "payload_too_large")
    return bytes(body)


async def completions(request: Request) -> Response:
    svc = _service(request)
    svc.authorize(request)
    engine = svc.admitting_engine()
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "Content-Type must be application/json", "unsupported_media_type")
    raw = await _read_body(request, svc.settings.max_body_bytes)
    if not raw.strip():
        raise invalid("body", "is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise invalid("body", f"is not valid JSON ({str(exc)[:120]})") from None
    assert svc.limits is not None
    req = parse_completion(data, svc.limits, svc.name)

    events: asyncio.Queue[Event] = asyncio.Queue()
    seq = Sequence(req.prompt, req.max_tokens, req.sampling, req.stop, emit=svc.handoff.to(events),
                   stream=req.stream)
    try:
        engine.submit(seq)
    except QueueFull:
        raise ApiError(429, "server is at capacity; retry later", "rate_limit_exceeded",
                       headers={"Retry-After": str(engine.retry_after())}) from None
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": svc.name}
    if req.stream:
        return StreamingResponse(_sse(engine, seq, events, req, meta), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, engine, seq, events, req, meta)


def _usage(req: CompletionRequest, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(req.prompt) + completion_tokens}


def _engine_failure(ev: Event) -> ApiError:
    if ev.finish_reason == "abort":  # drain ran out of time
        return ApiError(503, f"request aborted: {ev.error}", "unavailable")
    return ApiError(500, str(ev.error), "server_error")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _complete(request: Request, engine: Engine, seq: Sequence, events: asyncio.Queue[Event],
                    req: CompletionRequest, meta: dict[str, Any]) -> Response:
    # Watch for the client going away so an abandoned request frees its slot instead of running to max_tokens.
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    result = asyncio.ensure_future(events.get())  # a non-streamed sequence reports once, when finished
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not result.done():
        result.cancel()
        engine.cancel(seq)
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    ev = result.result()
    if ev.error:
        raise _engine_failure(ev)
    choice = {"text": decode(ev.data), "index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
    return JSONResponse({**meta, "choices": [choice], "usage": _usage(req, ev.completion_tokens)})


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(engine: Engine, seq: Sequence, events: asyncio.Queue[Event], req: CompletionRequest,
               meta: dict[str, Any]) -> AsyncIterator[str]:
    decoder = utf8_stream_decoder()
    finished = False
    try:
        while not finished:
            ev = await events.get()
            if ev.error:  # headers are gone already: report in-band, as OpenAI does
                err = _engine_failure(ev)
                yield _sse_line({"error": err.message, "error_type": err.error_type})
                break
            finished = ev.finish_reason is not None
            text = decoder.decode(ev.data, final=finished)
            if text or finished:
                choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
                yield _sse_line({**meta, "choices": [choice]})
        if finished and req.include_usage:
            yield _sse_line({**meta, "choices": [], "usage": _usage(req, ev.completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.cancel(seq)


# ---- error handling and metrics middleware ----------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    return JSONResponse({"error": str(exc.detail), "error_type": kind}, status_code=exc.status_code,
                        headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": "internal server error", "error_type": "server_error"}, status_code=500)


class ApiMetricsMiddleware:
    """Counts /v1/* responses by status code and times successful completions (streamed ones to the last byte)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # what the client sees if the app raises before answering

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (message["type"] == "http.response.body" and not message.get("more_body")
                  and 200 <= status < 300 and scope["path"] == COMPLETIONS_PATH):
                self.metrics.request_duration.observe(time.monotonic() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if status != 499:
                self.metrics.requests.labels(code=str(status)).inc()


def create_app(service: Service) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start_loading()
        watchdog = asyncio.ensure_future(_feed_watchdog(service))
        try:
            yield
        finally:
            watchdog.cancel()
            await asyncio.to_thread(service.shutdown)

    app = Starlette(
        routes=[
            Route(COMPLETIONS_PATH, completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[Middleware(ApiMetricsMiddleware, metrics=service.metrics)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.service = service
    return app


async def _feed_watchdog(service: Service) -> None:
    """WATCHDOG=1 at half the systemd interval, only while the engine (or the loader) makes progress.

    It runs on the event loop, so a blocked event loop stops the pings too.
    """
    interval = service.notifier.watchdog_seconds
    if not interval:
        return
    stalled = False
    while True:
        alive = service.alive()
        if alive:
            service.notifier.watchdog()
        if alive == stalled:  # log transitions only
            stalled = not alive
            if stalled:
                log.error("engine loop stalled; withholding the systemd watchdog ping")
            else:
                log.warning("engine loop progressing again; watchdog pings resumed")
        await asyncio.sleep(interval / 2)
