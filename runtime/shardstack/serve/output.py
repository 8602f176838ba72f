"""Output processing: from a step's logits to the text each waiting request receives.

`OutputProcessor` samples one token per row, appends it to its request, matches stop strings and EOS on the
incrementally decoded text (`TextStream`) and emits what may be released: one `Output` per released chunk for a
streamed request, one at the end otherwise. Failures are contained per request: a row that cannot be sampled, or an
exception in a request's stop handling or callback, ends that request alone with an error.

`Handoff` carries those outputs from the engine thread to the asyncio queue of the HTTP request waiting for them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import torch

from shardstack.model.tokenizer import Tokenizer
from shardstack.serve.metrics import EngineMetrics
from shardstack.serve.request import Output, Sequence
from shardstack.serve.sampling import sample
from shardstack.serve.text import TextStream

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int], metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids  # sampling one ends the request with finish_reason "stop" (its text is not sent)
        self.metrics = metrics

    def open(self, seq: Sequence) -> None:
        seq.text = TextStream(self.tokenizer, seq.stop)

    def process(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample the next token of each row of `logits` [B, V] and deliver what it releases."""
        tokens = sample(logits.float().cpu(), [s.params for s in seqs], [s.generator for s in seqs])
        now = time.monotonic()
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.cancelled:
                continue
            if token is None:
                log.warning("request %d: no token could be sampled (non-finite logits or unusable sampling "
                            "parameters %s); failing it alone", seq.id, seq.params)
                self.fail(seq, "sampling failed: the model produced non-finite logits or the sampling "
                          "parameters leave no token")
                continue
            try:
                self._advance(seq, token, now)
            except Exception as exc:
                log.exception("request %d failed after sampling; failing it alone", seq.id)
                self.fail(seq, f"engine error: {type(exc).__name__}")

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

    def fail(self, seq: Sequence, message: str) -> None:
        """End one sequence with an error; its slot is freed at the next retire."""
        seq.finished = True
        try:
            seq.emit(Output(error=message, completion_tokens=seq.generated))
        except Exception:  # its callback is what failed: nobody is left to tell
            log.exception("request %d: reporting its error failed too", seq.id)

    def abort(self, seq: Sequence, reason: str) -> None:
        if not seq.finished:
            seq.emit(Output(finish_reason="abort", error=reason, completion_tokens=seq.generated))


class Handoff:
    """Delivers engine outputs (engine thread) to per-request asyncio queues (event loop).

    The first output of a burst schedules one drain on the loop; the rest of the step's outputs ride along, so
    the loop wakes once per engine step rather than once per request per token.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue[Output], Output]] = []
        self._lock = threading.Lock()

    def to(self, queue: asyncio.Queue[Output]) -> Callable[[Output], None]:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return lambda ev: self._push(queue, ev)

    def _push(self, queue: asyncio.Queue[Output], ev: Output) -> None:
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
