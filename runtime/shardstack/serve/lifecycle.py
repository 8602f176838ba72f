"""The service's lifecycle: loading → ready → draining, or loading → failed.

The model loads on a background thread so `/health` can answer 503 while it does; READY=1 goes to systemd once
the model is warmed up *and* the server listens. `Service` owns the engine and everything the routes need to
decide what to answer; `feed_watchdog` pings systemd's watchdog only while the engine loop makes progress.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from starlette.requests import Request

from shardstack.errors import ShardstackError
from shardstack.model.manifest import Staged, stage_verified
from shardstack.model.tokenizer import Tokenizer
from shardstack.serve.apierror import ApiError
from shardstack.serve.chat import ChatTemplate, load_chat_template
from shardstack.serve.drain import DrainClock
from shardstack.serve.engine import Engine
from shardstack.serve.metrics import ServeMetrics
from shardstack.serve.notify import Notifier
from shardstack.serve.output import Handoff
from shardstack.serve.protocol import Limits, PromptContext, default_body_limit
from shardstack.serve.sampling import SamplingParams
from shardstack.serve.settings import ServeSettings, resolve_device, resolve_dtype
from shardstack.serve.text import eos_ids, model_tokenizer

log = logging.getLogger(__name__)


class Service:
    """Owns the engine and everything the routes need to decide what to answer."""

    def __init__(self, settings: ServeSettings, notifier: Notifier | None = None) -> None:
        self.settings = settings
        self.name = settings.model_name or settings.model_dir.resolve().name
        self.notifier = notifier or Notifier()
        self.metrics = ServeMetrics()
        self.phase = "loading"
        self.drain: DrainClock | None = None  # set when a drain starts
        self.failure: str | None = None
        self.engine: Engine | None = None
        self.meta: dict[str, Any] = {}
        self.verified: Staged | None = None  # what the signed manifest said, once the copy verified
        self.chat_template: ChatTemplate | None = None  # the model's, for /v1/chat/completions
        self.limits: Limits | None = None
        self.tokenizer: Tokenizer | None = None
        self.prompt: PromptContext | None = None  # what request validation needs of the model
        self.max_body_bytes: int | None = settings.max_body_bytes  # set at load when not given
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
        s = self.settings
        started = time.monotonic()
        staged = None
        try:
            if s.key is not None:
                # Verified as copied into a private directory, and loaded from there (model.manifest).
                staged = self.verified = stage_verified(s.model_dir, s.key, s.stage_dir)
                log.info("verified %s: %d files, %.1f MiB, step %s, signed with key id %s (%.1fs)", s.model_dir,
                         staged.files, staged.bytes / 2**20, staged.step, staged.key_id, time.monotonic() - started)
            self._load_from(staged.path if staged else s.model_dir, started)
        except ShardstackError as exc:  # a refusal with its reason, e.g. an export that does not verify
            reason = str(exc).replace("\n  hint:", "; hint:")  # one journal line
            log.error("cannot serve: %s", reason)
            self._fail(reason)
        except Exception as exc:
            log.exception("loading the model from %s failed", s.model_dir)
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            if staged is not None:  # everything is in memory now
                shutil.rmtree(staged.path, ignore_errors=True)

    def _fail(self, failure: str) -> None:
        self.failure = failure
        self.phase = "failed"
        self.notifier.status(f"failed: {self.failure}")
        self.on_failure()

    def _load_from(self, model_dir: Path, started: float) -> None:
        from shardstack.model.artifact import load_model

        s = self.settings
        self.device = resolve_device(s.device)
        self.dtype = resolve_dtype(s.dtype, self.device)
        model, meta = load_model(model_dir, self.device, self.dtype)
        model.eval()
        vocab = model.config.vocab_size
        tokenizer = model_tokenizer(model_dir, meta, vocab)
        self.chat_template = load_chat_template(model_dir)
        engine = Engine(model, tokenizer=tokenizer, eos_ids=eos_ids(model_dir, tokenizer),
                        context=s.context, max_batch=s.max_concurrency, max_queue=s.max_queue,
                        device=self.device, dtype=self.dtype, max_prefill_tokens=s.max_prefill_tokens,
                        metrics=self.metrics, failpoint=s.failpoint)
        context = engine.context
        self.limits = Limits(context=context, max_tokens=min(s.max_tokens or context, context - 1))
        ctx = PromptContext(tokenizer, vocab)
        self.tokenizer, self.prompt = tokenizer, ctx
        if self.max_body_bytes is None:
            self.max_body_bytes = default_body_limit(context, ctx.bytes_per_token)
        self.metrics.bind_heartbeat(lambda: engine.heartbeat_wall)
        engine.start()
        self.engine, self.meta = engine, meta
        # Warm-up: prefill and decode once so the first client does not pay for allocator and kernel setup.
        prompt = tokenizer.encode_prompt("warm up")[: max(1, context // 2)]
        engine.generate(prompt, max(1, min(4, context - len(prompt))), SamplingParams(seed=0), internal=True)
        log.info("model %s (%s) loaded and warmed up in %.1fs on %s (%s): %d params, tokenizer %s (%d tokens), "
                 "context %d (text prompts up to %d bytes, bodies up to %d), %d slots", self.name,
                 meta.get("arch", "gpt"), time.monotonic() - started, self.device,
                 str(self.dtype).removeprefix("torch."), model.num_params(), tokenizer.name, tokenizer.vocab_size,
                 context, (context - 1) * ctx.bytes_per_token, self.max_body_bytes, s.max_concurrency)
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
            self.drain = DrainClock(self.settings.drain_seconds, self.settings.drain_quiet_seconds)
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
            raise ApiError(401, "missing or invalid bearer token", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def admitting_engine(self) -> Engine:
        if self.drain is not None:
            self.drain.turned_away()
            raise ApiError(503, "server is draining; retry on another replica", code="unavailable",
                           headers={"Retry-After": "1"})
        if self.phase != "ready" or self.engine is None:
            raise ApiError(503, f"server is {self.phase}", code="unavailable", headers={"Retry-After": "5"})
        age = self.stalled()
        if age is not None:
            raise ApiError(503, f"engine loop has made no progress for {age:.0f}s", code="unavailable")
        return self.engine


async def feed_watchdog(service: Service) -> None:
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
