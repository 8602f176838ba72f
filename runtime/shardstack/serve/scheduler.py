"""The scheduler: which requests run in the next engine step. It owns the waiting queue, the running requests and
their KV-cache slots, and the admission policy; it runs no model (engine.py does) and samples nothing (output.py).

Each running request owns one slot. Every step admits waiting requests into free slots, first in first out, while
their padded prefill fits `max_prefill_tokens`, so no prompt can stall the decoding of the others for longer than
one such prefill. A prompt longer than that budget is admitted alone and prefilled in chunks of
`max_prefill_tokens`, one per step; requests behind it are admitted once its remaining chunk leaves room in a
step's budget. A request leaves the batch the moment it finishes and its slot is reused by the next step.

Callers on any thread submit and cancel; `schedule` and `retire` run on the engine thread. One condition guards
the queues and wakes the engine thread when work arrives.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from dataclasses import dataclass

from shardstack.serve.metrics import EngineMetrics
from shardstack.serve.request import Sequence


class QueueFull(Exception):
    """Admission refused: running + waiting already at capacity."""


@dataclass(frozen=True)
class Step:
    """What one engine step runs: the chunked prompt's next chunk, the requests admitted now (prefilled together),
    and every running request by slot (those past their prompt decode)."""

    chunk: Sequence | None
    admitted: list[Sequence]
    batch: list[Sequence]


class Scheduler:
    def __init__(self, *, max_batch: int, max_queue: int, max_prefill_tokens: int = 4096,
                 metrics: EngineMetrics | None = None) -> None:
        if max_prefill_tokens < 1:  # a step must make progress on a prompt
            raise ValueError("max_prefill_tokens must be at least 1")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics or EngineMetrics()
        # Lowest free slot first, and batches ordered by slot: a full (or packed) batch is slots 0..B-1, which
        # the model attends through a view of the cache instead of gathering it every step.
        self._free = list(range(max_batch))  # a heap
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._chunking: Sequence | None = None  # the running request prefilled in chunks (engine thread only)
        self._cond = threading.Condition()
        self.closed = False
        self._avg_seconds = 1.0  # EWMA of request time, for Retry-After

    # ---- any thread -----------------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a request, or raise QueueFull when running + waiting has reached capacity."""
        with self._cond:
            if len(self._running) + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull
            self._waiting.append(seq)
            self._report_depth()
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the request at the next step."""
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def cancel_all(self) -> list[Sequence]:
        """Cancel every queued and running request; returns them, for the caller to tell their clients."""
        with self._cond:
            victims = [*self._waiting, *self._running]
            for seq in victims:
                seq.cancelled = True
            self._cond.notify()
        return victims

    def close(self) -> None:
        """Wake the engine thread for good: `schedule` returns None from now on."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return len(self._running), len(self._waiting)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it, served max_batch at a time."""
        _running, waiting = self.counts()
        est = self._avg_seconds * (1 + waiting / max(1, self.max_batch))
        return max(1, min(60, round(est)))

    # ---- engine thread ------------------------------------------------------------------------------------
    def chunk(self, seq: Sequence) -> int:
        """How many prompt tokens `seq` prefills in this step."""
        return min(self.max_prefill_tokens, len(seq.prompt) - seq.pos)

    def schedule(self, timeout: float) -> Step | None:
        """Free finished slots and pick the next step's work; None when there was none for `timeout` seconds (the
        engine beats and asks again) or once closed."""
        with self._cond:
            self._retire()
            if self._chunking is not None and self._chunking.pos >= len(self._chunking.prompt):
                self._chunking = None  # its last chunk is in (and maybe a decode step): it decodes like any other
            while not self.closed and not self._running and not any(not s.cancelled for s in self._waiting):
                self._waiting.clear()
                self._report_depth()
                if not self._cond.wait(timeout):
                    return None
            if self.closed:
                return None
            # A prompt being chunked takes its next chunk out of this step's budget first.
            pending = self.chunk(self._chunking) if self._chunking is not None else 0
            admitted = self._admit(self.max_prefill_tokens - pending)
            batch = sorted((s for s in self._running if not s.cancelled), key=lambda s: s.slot)
            self._report_depth()
            return Step(self._chunking, admitted, batch)

    def retire(self) -> None:
        with self._cond:
            self._retire()
            self._report_depth()

    def _report_depth(self) -> None:
        self.metrics.queue_depth(len(self._running), len(self._waiting))

    def _admit(self, budget: int) -> list[Sequence]:
        """Move waiting requests into free slots while their padded prefill fits `budget` tokens; the admitted ones
        are returned for one padded prefill together. A prompt longer than the whole budget (which no batch can
        fit) becomes `_chunking` instead, when nothing else prefills in this step. Caller holds the lock."""
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
                # Wait (first in, first out) unless it is the only prefill of a step's whole budget.
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
