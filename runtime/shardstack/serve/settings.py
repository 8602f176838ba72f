"""The inference service's settings (what `shardstack serve` was told) and how `auto` resolves to a device and
dtype."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardstack.accel import decide_device, probe
from shardstack.errors import ShardstackError
from shardstack.model.dtypes import DTYPES
from shardstack.signing import SigningKey


@dataclass
class ServeSettings:
    model_dir: Path
    model_name: str | None = None  # default: the model directory's name
    max_concurrency: int = 8  # requests decoded together = KV-cache slots; 1 turns batching off
    max_queue: int = 32  # admitted requests waiting for a slot; beyond that: 429
    max_tokens: int | None = None  # per-request ceiling; default: the model context
    context: int | None = None  # tokens per KV-cache slot, at most the model's (default: the model's)
    max_body_bytes: int | None = None  # None: protocol.default_body_limit of the context and the tokenizer
    max_prefill_tokens: int = 4096  # prompt tokens per engine step (longer prompts are chunked): bounds the stall
    token: str | None = None  # bearer token for /v1/* and /info; None = open
    key: SigningKey | None = None  # verify the export's signed manifest (model.manifest); None = load unverified
    stage_dir: Path = Path("/var/tmp")  # where the verified copy is made while loading (removed after)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32) | float32 | bfloat16 | float16
    stall_seconds: float = 30.0  # /health turns 503 when the engine loop has not iterated for this long
    drain_seconds: float = 20.0  # on SIGTERM, how long in-flight requests get before they are aborted
    drain_quiet_seconds: float = 0.0  # and how long no request must have been turned away: drain.py
    access_log: str = "auto"  # auto (journal under journald, else off) | journal | stdout | off: accesslog.py
    journal_socket: str = "/run/systemd/journal/socket"  # journald's native socket (a test's own, in tests)
    failpoint: str | None = None  # test-only fault injection, see scheduler.FAILPOINT_HANG
    extra_info: dict[str, Any] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N → a device; on a node with NVIDIA GPUs that cannot run CUDA, auto and cuda refuse
    with the cause (shardstack.accel) instead of serving from CPU."""
    kind, _, index = name.partition(":")
    choice = decide_device(probe(), kind, setting="--device")
    if choice.type == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(index) if index else 0)
    if device.index >= torch.cuda.device_count():
        raise ShardstackError(f"--device {name}: this node has {torch.cuda.device_count()} CUDA device(s)",
                              hint="use cuda:0 … or auto")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]
