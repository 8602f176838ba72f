"""The scheduler: one engine loop that continuously batches concurrent requests over a `ModelRunner`.

Each running request owns one KV-cache slot. Every iteration the loop (1) admits waiting requests into free
slots and prefills them together (prompts right-padded to a common length: the padding writes cache entries
past each prompt's end, which that row's mask hides and its own decode steps later overwrite), then (2) runs
one decode step for every running request at its own position. A request leaves the batch the moment it
finishes, and its slot is reused on the next iteration, so short and long requests never wait for each other.

No iteration prefills more than `max_prefill_tokens` (padded) prompt tokens, so no prompt can stall the decoding
of the others for longer than one such prefill. A prompt longer than that budget is admitted alone and prefilled
in chunks of `max_prefill_tokens`, one per iteration, each continuing in its slot where the last one ended (the
cached forward takes a start position per row); the running requests decode between its chunks, and requests
behind it are admitted once its remaining chunk leaves room in an iteration's budget.

The loop runs on its own thread (torch releases the GIL inside kernels) and hands results to the caller
through a callback; the asyncio side wraps it with `loop.call_soon_threadsafe`. `heartbeat` is refreshed on
every iteration, including idle ones, so a stale heartbeat means the loop is stuck, not merely idle.

Failures are contained per request: whatever goes wrong with one sequence after the forward pass (a row that
cannot be sampled, an exception in its stop handling or its callback) ends that sequence alone with an error,
and the rest of the batch carries on in the same step. Only a fault of the step itself (the forward pass
raising, device out of memory) fails the whole batch; the loop keeps serving after either.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardstack.model.tokenizer import Tokenizer
from shardstack.serve.runner import Model, ModelRunner
from shardstack.serve.sampling import SamplingParams, make_generator, sample
from shardstack.serve.text import TextStream

log = logging.getLogger(__name__)

FAILPOINT_HANG = "engine_hang"  # test hook: block the loop once a client request is running


class QueueFull(Exception):
    """Admission refused: running + waiting already at capacity."""


@dataclass
class Output:
    """What the engine reports for a request: released text, and finally a finish reason or error."""

    data: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    error: str | None = None
    completion_tokens: int = 0


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    emit: Callable[[Output], None]
    internal: bool = False  # warm-up traffic: not counted in metrics, not subject to failpoints
    stream: bool = True  # False: one Output at the end instead of one per released chunk
    id: int = field(default_factory=itertools.count().__next__)
    arrived: float = field(default_factory=time.monotonic)
    slot: int = -1
    pos: int = 0  # tokens already in the cache (< len(prompt) while a long prompt is prefilled in chunks)
    last: int = -1  # last sampled token, the next decode input
    generated: int = 0
    first_token_at: float | None = None
    finished: bool = False
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.generator = make_generator(self.params.seed)
        self.text: TextStream | None = None  # the scheduler's tokenizer and this request's stops, set on submit
        self.held: list[str] = []  # released text of a non-streamed request


class SchedulerMetrics:
    """Hooks the engine calls; the default does nothing (the app plugs Prometheus in)."""

    def queue_depth(self, running: int, waiting: int) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def step(self, batch: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        model: Model,
        *,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int] = frozenset(),
        context: int | None = None,
        max_batch: int,
        max_queue: int,
        device: torch.device | str,
        dtype: torch.dtype,
        max_prefill_tokens: int = 4096,
        metrics: SchedulerMetrics | None = None,
        failpoint: str | None = None,
    ) -> None:
        if max_prefill_tokens < 1:  # a step must make progress on a prompt
            raise ValueError("max_prefill_tokens must be at least 1")
        # The KV cache holds `context` tokens per slot: the model's, or less (a Hugging Face Llama 3 says 128k).
        self.context = min(model.config.seq_len, context or model.config.seq_len)
        self.runner = ModelRunner(model, slots=max_batch, context=self.context, device=device, dtype=dtype)
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids  # sampling one ends the request with finish_reason "stop" (its text is not sent)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.device = self.runner.device
        self.metrics = metrics or SchedulerMetrics()
        self.failpoint = failpoint
        # Lowest free slot first, and batches ordered by slot: a full (or packed) batch is slots 0..B-1, which
        # the model attends through a view of the cache instead of gathering it every step.
        self._free = list(range(max_batch))  # a heap
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._chunking: Sequence | None = None  # the running request prefilled in chunks (engine thread only)
        self._cond = threading.Condition()
        self._stop = False
        self._hang = threading.Event()
        self.heartbeat = time.monotonic()
        self.heartbeat_wall = time.time()
        self.steps = 0
        self.idle_tick = 0.25
        self._avg_seconds = 1.0  # EWMA of request time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="shardstack-engine", daemon=True)

    # ---- caller side (any thread) ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._hang.set()
        self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a request, or raise QueueFull when running + waiting has reached capacity."""
        if len(seq.prompt) + seq.max_tokens > self.context:
            raise ValueError("prompt + max_tokens exceeds the model context")
        seq.text = TextStream(self.tokenizer, seq.stop)
        with self._cond:
            if len(self._running) + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull
            self._waiting.append(seq)
            self._report_depth()
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the request at the next iteration."""
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def abort_all(self, reason: str) -> int:
        """Finish every queued and running request now (used when a drain runs out of time)."""
        with self._cond:
            victims = [*self._waiting, *self._running]
            for seq in victims:
                seq.cancelled = True
            self._cond.notify()
        for seq in victims:
            if not seq.finished:
                seq.emit(Output(finish_reason="abort", error=reason, completion_tokens=seq.generated))
        return len(victims)

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return len(self._running), len(self._waiting)

    def in_flight(self) -> int:
        running, waiting = self.counts()
        return running + waiting

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it, served max_batch at a time."""
        _running, waiting = self.counts()
        est = self._avg_seconds * (1 + waiting / max(1, self.max_batch))
        return max(1, min(60, round(est)))

    def generate(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop: list[str] | None = None,
                 *, internal: bool = False, timeout: float = 600.0) -> tuple[str, str]:
        """Blocking helper (warm-up, tests): run one request through the loop and return (text, finish)."""
        done = threading.Event()
        parts: list[str] = []
        result: list[Output] = []

        def emit(ev: Output) -> None:
            parts.append(ev.data)
            if ev.finish_reason or ev.error:
                result.append(ev)
                done.set()

        self.submit(Sequence(prompt, max_tokens, params, stop or [], emit, internal=internal))
        if not done.wait(timeout):
            raise TimeoutError("engine did not finish the request in time")
        if result[0].error:
            raise RuntimeError(result[0].error)
        return "".join(parts), str(result[0].finish_reason)

    # ---- engine thread -----------------------------------------------------------------------------------
    def _beat(self) -> None:
        self.heartbeat = time.monotonic()
        self.heartbeat_wall = time.time()

    def _report_depth(self) -> None:
        self.metrics.queue_depth(len(self._running), len(self._waiting))

    def _chunk(self, seq: Sequence) -> int:
        """How many prompt tokens `seq` prefills in this iteration."""
        return min(self.max_prefill_tokens, len(seq.prompt) - seq.pos)

    def _admit(self, budget: int) -> list[Sequence]:
        """Move waiting requests into free slots while their padded prefill fits `budget` tokens; the admitted ones
        are returned for one padded prefill together. A prompt longer than the whole budget (which no batch can
        fit) becomes `_chunking` instead, when nothing else prefills in this iteration. Caller holds the lock."""
        admitted: list[Sequence] = []
        longest = 0
        while self._waiting and self._free:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            longest_if = max(longest, len(seq.prompt))
            chunked = False
            if (len(admitted) + 1) * longest_if > budget:
                # Wait (first in, first out) unless it is the only prefill of an iteration's whole budget.
                if admitted or self._chunking is not None or len(seq.prompt) <= self.max_prefill_tokens:
                    break
                chunked = True
            self._waiting.popleft()
            seq.slot = heapq.heappop(self._free)
            self._running.append(seq)
            if chunked:
                self._chunking = seq
                break
            admitted.append(seq)
            longest = longest_if
        return admitted

    def _run(self) -> None:
        kv_bytes = self.runner.kv_cache_bytes()
        log.info("engine loop started: %d slots x %d tokens on %s, KV cache %.1f MiB", self.max_batch, self.context,
                 self.device, kv_bytes / 2**20)
        while True:
            with self._cond:
                self._beat()
                self._retire()
                while not self._stop and not self._running and not any(not s.cancelled for s in self._waiting):
                    self._waiting.clear()
                    self._report_depth()
                    self._cond.wait(self.idle_tick)
                    self._beat()
                if self._stop:
                    return
                # A prompt being chunked takes its next chunk out of this iteration's budget first.
                pending = self._chunk(self._chunking) if self._chunking is not None else 0
                admitted = self._admit(self.max_prefill_tokens - pending)
                chunking = self._chunking
                batch = sorted((s for s in self._running if not s.cancelled), key=lambda s: s.slot)
                self._report_depth()
            if self.failpoint == FAILPOINT_HANG and any(not s.internal for s in batch):
                log.warning("failpoint %s: engine loop blocks now", FAILPOINT_HANG)
                self._hang.wait()  # released only by stop()
                return
            try:
                with torch.inference_mode():
                    # Two passes, not one padded one: a chunk starts mid-sequence, and padding it to the fresh
                    # prompts' length could run past the context.
                    if chunking is not None and not chunking.cancelled:
                        self._prefill([chunking])
                    fresh = [s for s in admitted if not s.cancelled]
                    if fresh:
                        self._prefill(fresh)
                    # Fresh ones too (their 2nd token); not a prompt still being chunked (nothing sampled yet).
                    decoding = [s for s in batch if not s.finished and s.generated]
                    if decoding:
                        self._decode(decoding)
                self.steps += 1
                self.metrics.step(len(batch))
                with self._cond:
                    self._retire()
                    self._report_depth()
            except Exception as exc:  # a fault of the step itself (e.g. device OOM): fail this batch, keep serving
                log.exception("engine step failed; failing %d request(s)", len(batch))
                for seq in batch:
                    if not seq.finished:
                        self._fail(seq, f"engine error: {type(exc).__name__}")

    def _retire(self) -> None:
        """Free the slots of finished or cancelled requests. Caller holds the lock."""
        keep = []
        for seq in self._running:
            if seq.finished or seq.cancelled:
                heapq.heappush(self._free, seq.slot)
                if seq is self._chunking:
                    self._chunking = None
                if seq.finished and not seq.internal:
                    self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * (time.monotonic() - seq.arrived)
            else:
                keep.append(seq)
        self._running = keep

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill each sequence's next chunk (a fresh prompt's all of it) in one padded pass; those whose prompt
        is then all in the cache sample their first token. Rows must all start at 0, or be one row alone."""
        ends = [s.pos + self._chunk(s) for s in seqs]
        rows = self.runner.prefill([s.prompt[s.pos:end] for s, end in zip(seqs, ends, strict=True)],
                                   [s.slot for s in seqs], [s.pos for s in seqs])
        for seq, end in zip(seqs, ends, strict=True):
            if not seq.internal:
                self.metrics.tokens(end - seq.pos, 0)
            seq.pos = end
        done = [row for row, s in enumerate(seqs) if s.pos == len(s.prompt)]
        if self._chunking is not None and self._chunking.pos == len(self._chunking.prompt):
            self._chunking = None  # that was its last chunk: from now on it decodes like any other
        if done:
            self._sample_and_emit([seqs[row] for row in done], rows[done])

    def _decode(self, seqs: list[Sequence]) -> None:
        logits = self.runner.decode([s.last for s in seqs], [s.slot for s in seqs], [s.pos for s in seqs])
        for seq in seqs:
            seq.pos += 1
        self._sample_and_emit(seqs, logits)

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens = sample(logits.float().cpu(), [s.params for s in seqs], [s.generator for s in seqs])
        now = time.monotonic()
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.cancelled:
                continue
            if token is None:
                log.warning("request %d: no token could be sampled (non-finite logits or unusable sampling "
                            "parameters %s); failing it alone", seq.id, seq.params)
                self._fail(seq, "sampling failed: the model produced non-finite logits or the sampling "
                           "parameters leave no token")
                continue
            try:
                self._advance(seq, token, now)
            except Exception as exc:
                log.exception("request %d failed after sampling; failing it alone", seq.id)
                self._fail(seq, f"engine error: {type(exc).__name__}")

    def _advance(self, seq: Sequence, token: int, now: float) -> None:
        """Append one sampled token to a sequence, apply its stop sequences and hand out what is releasable."""
        seq.last = token
        seq.generated += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            if not seq.internal:
                self.metrics.first_token(now - seq.arrived)
        if not seq.internal:
            self.metrics.tokens(0, 1)
        assert seq.text is not None
        finish = None
        if token in self.eos_ids:  # the model ended the text: release what is held, not the EOS token's own text
            data, _ = seq.text.finish()
            finish = "stop"
        else:
            data, stopped = seq.text.push(token)
            if stopped:
                finish = "stop"
            elif seq.generated >= seq.max_tokens:
                more, stopped = seq.text.finish()
                data += more
                finish = "stop" if stopped else "length"
        if finish:
            seq.finished = True
        if not seq.stream:
            seq.held.append(data)
            if finish:
                seq.emit(Output(data="".join(seq.held), finish_reason=finish, completion_tokens=seq.generated))
        elif data or finish:
            seq.emit(Output(data=data, finish_reason=finish, completion_tokens=seq.generated))

    def _fail(self, seq: Sequence, message: str) -> None:
        """End one sequence with an error; its slot is freed at the next retire."""
        seq.finished = True
        try:
            seq.emit(Output(error=message, completion_tokens=seq.generated))
        except Exception:  # its callback is what failed: nobody is left to tell
            log.exception("request %d: reporting its error failed too", seq.id)
