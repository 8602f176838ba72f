"""The OpenAI-compatible request schema for `POST /v1/completions`, validated by hand into typed values.

Every rejection is an `ApiError` carrying the HTTP status, a stable `error_type` and the offending field, and
becomes the JSON body `{"error": message, "error_type": type, "field": field}`. Anything a client can send
maps to a 4xx here; 5xx is reserved for faults of the service itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardstack.serve.sampling import SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_STOP_BYTES = 64
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts

# Accepted OpenAI fields that this engine cannot honour: allowed only at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
          "user", *_NEUTRAL}


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str, *, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.field = field
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.message, "error_type": self.error_type}
        if self.field:
            out["field"] = self.field
        return out


def invalid(field: str, message: str) -> ApiError:
    return ApiError(422, f"{field}: {message}", "invalid_request_error", field=field)


@dataclass(frozen=True)
class Limits:
    context: int  # model context in tokens: prompt + generated must fit
    max_tokens: int  # per-request ceiling for max_tokens
    default_max_tokens: int = 16


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[bytes]
    stream: bool
    include_usage: bool
    model: str | None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, field: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise invalid(field, "must be a number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise invalid(field, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _prompt(v: Any) -> list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]  # OpenAI's batch form with a single prompt
    if isinstance(v, str):
        tokens = list(v.encode("utf-8"))
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        if not all(0 <= t < 256 for t in v):
            raise invalid("prompt", "token ids must be in [0, 255] (byte-level tokenizer)")
        tokens = list(v)
    elif isinstance(v, list) and len(v) > 1 and all(isinstance(t, str) for t in v):
        raise invalid("prompt", "only one prompt per request is supported")
    else:
        raise invalid("prompt", "must be a string or a list of token ids")
    if not tokens:
        raise invalid("prompt", "must not be empty")
    return tokens


def _stop(v: Any) -> list[bytes]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("stop", "must be a string or a list of strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} sequences")
    out = [s.encode("utf-8") for s in items]
    if any(not s or len(s) > MAX_STOP_BYTES for s in out):
        raise invalid("stop", f"each sequence must be 1 to {MAX_STOP_BYTES} bytes")
    return out


def parse_completion(body: Any, limits: Limits, served_model: str) -> CompletionRequest:
    """Validate a decoded JSON body; raises ApiError (422, or 404 for an unknown model)."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise invalid(unknown[0], "unknown field")
    for field, neutral in _NEUTRAL.items():
        if field in body and body[field] is not None and body[field] != neutral:
            raise invalid(field, f"not supported by this server (only {neutral!r})")

    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise invalid("model", "must be a string")
        if model != served_model:
            raise ApiError(404, f"model {model!r} is not served here (this server serves {served_model!r})",
                           "model_not_found", field="model")
    if "prompt" not in body:
        raise invalid("prompt", "is required")
    prompt = _prompt(body["prompt"])

    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens)
    elif not _is_int(max_tokens):
        raise invalid("max_tokens", "must be an integer")
    elif not 1 <= max_tokens <= limits.max_tokens:
        raise invalid("max_tokens", f"must be in [1, {limits.max_tokens}], got {max_tokens}")
    if len(prompt) >= limits.context:
        raise invalid("prompt", f"{len(prompt)} tokens does not fit the model context of {limits.context}")
    if len(prompt) + max_tokens > limits.context:
        raise invalid("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                      f"model context of {limits.context}")

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]):
        raise invalid("seed", "must be a 64-bit integer")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", 'must be an object with only "include_usage"')
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("stream_options.include_usage", "must be a boolean")
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "must be a string")
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        model=model,
    )
