"""The engine: one loop on its own thread that continuously batches concurrent requests over a `ModelRunner`.

Every step it asks the `Scheduler` what to run, prefills the admitted prompts together (right-padded to a common
length: the padding writes cache entries past each prompt's end, which that row's mask hides and its own decode
steps later overwrite) and a chunked prompt's next chunk, then runs one decode step for every running request at
its own position; the `OutputProcessor` turns each pass's logits into tokens and text for the waiting requests.

The loop runs on its own thread (torch releases the GIL inside kernels) and hands results to the caller through
each request's callback. `heartbeat` is refreshed on every iteration, including idle ones, so a stale heartbeat
means the loop is stuck, not merely idle. Only a fault of the step itself (the forward pass raising, device out
of memory) fails the whole batch; the loop keeps serving after it.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from shardstack.model.tokenizer import Tokenizer
from shardstack.serve.metrics import EngineMetrics
from shardstack.serve.output import OutputProcessor
from shardstack.serve.request import Output, Sequence
from shardstack.serve.runner import Model, ModelRunner
from shardstack.serve.sampling import SamplingParams
from shardstack.serve.scheduler import Scheduler, Step

log = logging.getLogger(__name__)

FAILPOINT_HANG = "engine_hang"  # test hook: block the loop once a client request is running


class Engine:
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
        metrics: EngineMetrics | None = None,
        failpoint: str | None = None,
    ) -> None:
        self.metrics = metrics or EngineMetrics()
        self.scheduler = Scheduler(max_batch=max_batch, max_queue=max_queue, max_prefill_tokens=max_prefill_tokens,
                                   metrics=self.metrics)
        self.output = OutputProcessor(tokenizer, eos_ids, self.metrics)
        # The KV cache holds `context` tokens per slot: the model's, or less (a Hugging Face Llama 3 says 128k).
        self.context = min(model.config.seq_len, context or model.config.seq_len)
        self.runner = ModelRunner(model, slots=max_batch, context=self.context, device=device, dtype=dtype)
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.device = self.runner.device
        self.failpoint = failpoint
        self._hang = threading.Event()
        self.heartbeat = time.monotonic()
        self.heartbeat_wall = time.time()
        self.steps = 0
        self.idle_tick = 0.25
        self._thread = threading.Thread(target=self._run, name="shardstack-engine", daemon=True)

    # ---- caller side (any thread) ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.scheduler.close()
        self._hang.set()
        self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a request, or raise QueueFull when running + waiting has reached capacity."""
        if len(seq.prompt) + seq.max_tokens > self.context:
            raise ValueError("prompt + max_tokens exceeds the model context")
        self.output.open(seq)
        self.scheduler.submit(seq)

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.cancel(seq)

    def abort_all(self, reason: str) -> int:
        """Finish every queued and running request now (used when a drain runs out of time)."""
        victims = self.scheduler.cancel_all()
        for seq in victims:
            self.output.abort(seq, reason)
        return len(victims)

    def counts(self) -> tuple[int, int]:
        return self.scheduler.counts()

    def in_flight(self) -> int:
        return sum(self.counts())

    def retry_after(self) -> int:
        return self.scheduler.retry_after()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat

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
    def _run(self) -> None:
        log.info("engine loop started: %d slots x %d tokens on %s, KV cache %.1f MiB", self.scheduler.max_batch,
                 self.context, self.device, self.runner.kv_cache_bytes() / 2**20)
        while True:
            step = self.scheduler.schedule(self.idle_tick)
            # After the wait, not before: a loop that hangs on the step it just took has a heartbeat from then.
            self.heartbeat, self.heartbeat_wall = time.monotonic(), time.time()
            if step is None:
                if self.scheduler.closed:
                    return
                continue
            if self.failpoint == FAILPOINT_HANG and any(not s.internal for s in step.batch):
                log.warning("failpoint %s: engine loop blocks now", FAILPOINT_HANG)
                self._hang.wait()  # released only by stop()
                return
            try:
                self._step(step)
            except Exception as exc:  # a fault of the step itself (e.g. device OOM): fail this batch, keep serving
                log.exception("engine step failed; failing %d request(s)", len(step.batch))
                for seq in step.batch:
                    if not seq.finished:
                        self.output.fail(seq, f"engine error: {type(exc).__name__}")

    def _step(self, step: Step) -> None:
        with torch.inference_mode():
            # Two passes, not one padded one: a chunk starts mid-sequence, and padding it to the fresh prompts'
            # length could run past the context.
            if step.chunk is not None and not step.chunk.cancelled:
                self._prefill([step.chunk])
            fresh = [s for s in step.admitted if not s.cancelled]
            if fresh:
                self._prefill(fresh)
            # Fresh ones too (their 2nd token); not a prompt still being chunked (nothing sampled yet).
            decoding = [s for s in step.batch if not s.finished and s.generated]
            if decoding:
                logits = self.runner.decode([s.last for s in decoding], [s.slot for s in decoding],
                                            [s.pos for s in decoding])
                for seq in decoding:
                    seq.pos += 1
                self.output.process(decoding, logits)
        self.steps += 1
        self.metrics.step(len(step.batch))
        self.scheduler.retire()

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill each sequence's next chunk (a fresh prompt's all of it) in one padded pass; those whose prompt
        is then all in the cache sample their first token. Rows must all start at 0, or be one row alone."""
        ends = [s.pos + self.scheduler.chunk(s) for s in seqs]
        rows = self.runner.prefill([s.prompt[s.pos:end] for s, end in zip(seqs, ends, strict=True)],
                                   [s.slot for s in seqs], [s.pos for s in seqs])
        for seq, end in zip(seqs, ends, strict=True):
            if not seq.internal:
                self.metrics.tokens(end - seq.pos, 0)
            seq.pos = end
        done = [row for row, s in enumerate(seqs) if s.pos == len(s.prompt)]
        if done:
            self.output.process([seqs[row] for row in done], rows[done])
