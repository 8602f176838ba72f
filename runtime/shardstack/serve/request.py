"""A request as the engine holds it (`Sequence`) and what it hands back (`Output`).

The scheduler moves a `Sequence` between its queue and a KV-cache slot, the engine loop advances its position,
and the output processor appends its sampled tokens; `emit` is how the output reaches whoever waits for it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardstack.serve.sampling import SamplingParams, make_generator
from shardstack.serve.text import TextStream


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
        self.text: TextStream | None = None  # the engine's tokenizer and this request's stops, set on submit
        self.held: list[str] = []  # released text of a non-streamed request
