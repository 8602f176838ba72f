"""The OpenAI-compatible request schemas for `POST /v1/completions` and `POST /v1/chat/completions` (pydantic v2):
the raw body to a typed request, or a 4xx.

`parse_completion` and `parse_chat` turn the raw body into a typed `CompletionRequest` or raise `ApiError`. It is
CPU work that grows with the body (JSON, validation, rendering and encoding the prompt), so the app runs it on a
worker thread, and text longer in bytes than any prompt that fits the context could be is refused before it is
encoded (`PromptContext.bytes_per_token`). The body is decoded with the standard library (strict UTF-8) and
validated in strict mode: no coercion of `"5"` to 5 or `true` to 1, unknown fields are errors (a typo like
`max_token` does not pass silently), text must be valid Unicode (a lone UTF-16 surrogate escape is refused by name),
and sampling values must be ones float32 can honour. Anything a client can send maps to a 4xx; 5xx is reserved for
faults of the service itself.

Errors are serve/apierror.py's `ApiError`, in OpenAI's shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from shardstack.model.tokenizer import Tokenizer
from shardstack.serve.apierror import ApiError, clip, invalid
from shardstack.serve.chat import ChatTemplate, ChatTemplateError
from shardstack.serve.sampling import FLOAT32_TINY, SamplingParams
from shardstack.serve.text import max_input_bytes_per_token

MAX_STOP_SEQUENCES = 4
MAX_STOP_BYTES = 64
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # json.loads turns "\ud800" into a lone surrogate, which is not Unicode
        raise PydanticCustomError("unicode", "is not valid Unicode (it contains a lone UTF-16 surrogate at character "
                                  "{index})", {"index": exc.start}) from None
    return text


def _float32(value: float) -> float:
    if 0 < value < FLOAT32_TINY:
        raise PydanticCustomError("float32", "positive values below {tiny} are not normal float32 numbers, and "
                                  "sampling runs in float32", {"tiny": f"{FLOAT32_TINY:.4g}"})
    return value


def _prompt(v: Any, info: ValidationInfo) -> list[int]:
    """A string or a one-element list of strings (OpenAI's batch form), encoded with the served model's tokenizer, or
    token ids, which must be in its vocabulary (`PromptContext`, given at validation)."""
    ctx: PromptContext = info.context["prompt"]
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if isinstance(v, str):
        tokens = ctx.tokenizer.encode_prompt(_unicode(v)) if v else []
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if not all(0 <= t < ctx.vocab_size for t in v):
            raise PydanticCustomError("token_id", "token ids must be in [0, {last}] (the model's vocabulary)",
                                      {"last": ctx.vocab_size - 1})
        tokens = v
    elif isinstance(v, list) and len(v) > 1 and all(isinstance(t, str) for t in v):
        raise PydanticCustomError("one_prompt", "only one prompt per request is supported")
    else:
        raise PydanticCustomError("prompt_type", "must be a string or a list of token ids")
    if not tokens:
        raise PydanticCustomError("empty", "must not be empty")
    return tokens


def _stop_list(v: Any) -> Any:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")
    return v


def _stop_bytes(text: str) -> str:
    if not 1 <= len(text.encode("utf-8")) <= MAX_STOP_BYTES:
        raise PydanticCustomError("stop_length", "each sequence must be 1 to {limit} bytes", {"limit": MAX_STOP_BYTES})
    return text


def _only(neutral: Any) -> BeforeValidator:
    """An OpenAI field this engine cannot honour: accepted only at its neutral value (or null)."""

    def check(v: Any) -> Any:
        if v is not None and v != neutral:
            raise PydanticCustomError("unsupported", "not supported by this server (only {neutral})",
                                      {"neutral": json.dumps(neutral)})
        return v

    return BeforeValidator(check)


Text = Annotated[str, AfterValidator(_unicode)]
Sampling = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_float32)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class Generation(BaseModel):
    """What both endpoints take besides their prompt: the model, sampling, stop, streaming, and OpenAI's fields this
    engine honours only at their neutral value. Limits that depend on the served model are checked in `_request`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Sampling, Field(ge=0, le=2)] | None = None  # 0 = greedy
    top_p: Annotated[Sampling, Field(gt=0, le=1)] | None = None
    stop: Annotated[list[Annotated[Text, AfterValidator(_stop_bytes)]], Field(max_length=MAX_STOP_SEQUENCES),
                    BeforeValidator(_stop_list)] | None = None
    seed: Annotated[int, Field(ge=_SEED_RANGE[0], le=_SEED_RANGE[1])] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    n: Annotated[Any, _only(1)] = None
    presence_penalty: Annotated[Any, _only(0)] = None
    frequency_penalty: Annotated[Any, _only(0)] = None
    logit_bias: Annotated[Any, _only(None)] = None


class CompletionBody(Generation):
    """`POST /v1/completions`."""

    prompt: Annotated[list[int], BeforeValidator(_prompt)]
    best_of: Annotated[Any, _only(1)] = None
    echo: Annotated[Any, _only(False)] = None
    logprobs: Annotated[Any, _only(None)] = None
    suffix: Annotated[Any, _only(None)] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(Generation):
    """`POST /v1/chat/completions`: messages instead of a prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[Any, _only(False)] = None
    top_logprobs: Annotated[Any, _only(None)] = None
    tools: Annotated[Any, _only(None)] = None
    tool_choice: Annotated[Any, _only(None)] = None
    response_format: Annotated[Any, _only(None)] = None


@dataclass(frozen=True)
class PromptContext:
    """What validating a prompt needs of the served model."""

    tokenizer: Tokenizer
    vocab_size: int  # the model's embedding rows: token ids must be below it
    bytes_per_token: int = 0  # most prompt bytes one token stands for; 0: text.max_input_bytes_per_token's

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:  # derived once, at load: reading a large vocabulary is not per-request work
            object.__setattr__(self, "bytes_per_token", max_input_bytes_per_token(self.tokenizer))


# A body's bytes per prompt token at most: JSON spells a byte as at most 6 ("\u0001"), a token id with its
# separator and some whitespace in well under 16; plus room for every other field.
_JSON_BYTES_PER_BYTE, _JSON_BYTES_PER_ID, _BODY_SLACK = 6, 16, 64 << 10


def default_body_limit(context: int, bytes_per_token: int) -> int:
    """The body size limit when none is set: room for the largest prompt that can fit `context` tokens, as text
    (however escaped) or as token ids, and the other fields."""
    per_token = max(_JSON_BYTES_PER_BYTE * bytes_per_token, _JSON_BYTES_PER_ID)
    return _BODY_SLACK + (context - 1) * per_token


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
    stop: list[str]
    stream: bool
    include_usage: bool
    model: str | None


def _rejection(exc: ValidationError) -> ApiError:
    """The first validation error as a 400; `param` is the field path up to the first list index."""
    err = exc.errors(include_url=False, include_input=False)[0]
    path = []
    for part in err["loc"]:
        if not isinstance(part, str):
            break
        path.append(part)
    param = ".".join(path) or None
    if err["type"] == "extra_forbidden":
        return invalid(param, "unknown field")
    if err["type"] == "string_unicode":  # a field name holding a lone surrogate fails before any field validator
        return invalid(param, "a field name is not valid Unicode (it contains a lone UTF-16 surrogate)")
    return invalid(param, err["msg"])


def _check_text_bytes(size: int, param: str, limits: Limits, prompt: PromptContext) -> None:
    """Refuse `size` bytes of text too long to fit the context, before anything encodes it: N bytes are at least
    ceil(N / bytes_per_token) tokens."""
    least = math.ceil(size / prompt.bytes_per_token)
    if least >= limits.context:
        raise invalid(param, f"{size} bytes of text cannot be fewer than {least} tokens with this tokenizer, "
                      f"which does not fit the model context of {limits.context}", code="context_length_exceeded")


def _prompt_bytes(value: Any) -> int:
    """The UTF-8 size of a text prompt (0 for anything else, which is left to validation)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0  # a lone surrogate: later


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise invalid(None, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise invalid(None, f"the request body is not valid JSON ({clip(str(exc), 120)})",
                      code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    return data


def _served(model: str | None, served_model: str) -> None:
    if model is not None and model != served_model:
        raise ApiError(404, f"model {clip(model)!r} is not served here (this server serves {served_model!r})",
                       code="model_not_found", param="model")


def _request(body: Generation, prompt: list[int], prompt_param: str, max_tokens: int | None, max_tokens_param: str,
             limits: Limits) -> CompletionRequest:
    """The generation a validated body asks for, checked against the served model's limits."""
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens)
    elif max_tokens > limits.max_tokens:
        raise invalid(max_tokens_param, f"must be in [1, {limits.max_tokens}], got {clip(str(max_tokens))}")
    if len(prompt) >= limits.context:
        raise invalid(prompt_param, f"{len(prompt)} tokens does not fit the model context of {limits.context}",
                      code="context_length_exceeded")
    if len(prompt) + max_tokens > limits.context:
        raise invalid(max_tokens_param, f"{prompt_param} ({len(prompt)} tokens) + {max_tokens_param} "
                      f"({max_tokens}) exceeds the model context of {limits.context}", code="context_length_exceeded")
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
        ),
        stop=list(body.stop or []),
        stream=stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        model=body.model,
    )


def parse_completion(raw: bytes, limits: Limits, served_model: str, prompt: PromptContext) -> CompletionRequest:
    """Validate a raw request body and encode its prompt; raises ApiError (400, or 404 for a model not served
    here)."""
    data = _json_object(raw)
    _check_text_bytes(_prompt_bytes(data.get("prompt")), "prompt", limits, prompt)
    try:
        body = CompletionBody.model_validate(data, context={"prompt": prompt})
    except ValidationError as exc:
        raise _rejection(exc) from None
    _served(body.model, served_model)
    return _request(body, body.prompt, "prompt", body.max_tokens, "max_tokens", limits)


def _message_bytes(messages: Any) -> int:
    """The UTF-8 size of the messages' text, for the size check before any template or tokenizer runs (what is
    not well-formed is left to validation)."""
    size = 0
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        parts = [content] if isinstance(content, str) else \
            [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        size += sum(len(t.encode("utf-8", "surrogatepass")) for t in parts if isinstance(t, str))
    return size


def parse_chat(raw: bytes, limits: Limits, served_model: str, prompt: PromptContext,
               template: ChatTemplate | None) -> CompletionRequest:
    """Validate a chat request, render its messages with the model's chat template and encode the result; raises
    ApiError like parse_completion (and 400 for a model without a chat template or messages it refuses)."""
    data = _json_object(raw)
    _check_text_bytes(_message_bytes(data.get("messages")), "messages", limits, prompt)
    try:
        body = ChatBody.model_validate(data)
    except ValidationError as exc:
        raise _rejection(exc) from None
    _served(body.model, served_model)
    if template is None:
        raise ApiError(400, f"model {served_model!r} has no chat template (tokenizer_config.json's chat_template); "
                       "send a prompt to /v1/completions", code="chat_template_missing", param="messages")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("max_completion_tokens", "give it or max_tokens, not both")
    try:
        text = template.render([{"role": m.role, "content": m.text()} for m in body.messages])
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
    ids = prompt.tokenizer.encode(text)
    if not ids:
        raise invalid("messages", "the chat template rendered them as an empty prompt")
    if body.max_completion_tokens is not None:
        return _request(body, ids, "messages", body.max_completion_tokens, "max_completion_tokens", limits)
    return _request(body, ids, "messages", body.max_tokens, "max_tokens", limits)
