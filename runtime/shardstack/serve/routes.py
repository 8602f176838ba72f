"""The HTTP routes: OpenAI-compatible completions and chat completions (plain or server-sent events), health, info,
models, metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from shardstack import __version__
from shardstack.serve.accesslog import request_fields
from shardstack.serve.apierror import ApiError
from shardstack.serve.engine import Engine
from shardstack.serve.lifecycle import Service
from shardstack.serve.protocol import CompletionRequest, parse_chat, parse_completion
from shardstack.serve.request import Output, Sequence
from shardstack.serve.scheduler import QueueFull

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
GENERATE_PATHS = (COMPLETIONS_PATH, CHAT_PATH)


@dataclass(frozen=True)
class Shape:
    """How one kind of generation is answered: OpenAI's object names and choice shapes for text and for chat."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def chunk(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        if not self.chat:
            return self.choice(text, finish)
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


TEXT = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


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
    # A Hugging Face directory records no step; its signed manifest does (as vLLM's /info reports it).
    step = svc.meta.get("step")
    if step is None and svc.verified:
        step = svc.verified.step
    body: dict[str, Any] = {
        "model": svc.name,
        "engine": "builtin",
        "host": socket.gethostname(),  # which replica answered, behind a load balancer
        "model_dir": str(s.model_dir),
        "phase": svc.phase,
        "version": __version__,
        "arch": svc.meta.get("arch", "gpt") if svc.meta else None,
        "format": svc.meta.get("format", "shardstack") if svc.meta else None,
        "tokenizer": None,
        "checkpoint": svc.meta.get("source_checkpoint"),
        "step": step,
        # How the weights were checked: the signed manifest's key id, or null (--allow-unsigned).
        "signed_by": svc.verified.key_id if svc.verified else None,
        "chat_template": svc.chat_template is not None,  # whether /v1/chat/completions can serve this model
        "dtype": str(svc.dtype).removeprefix("torch.") if svc.dtype else None,
        "device": str(svc.device) if svc.device else None,
        "limits": {
            "max_concurrency": s.max_concurrency,
            "max_queue": s.max_queue,
            "max_tokens": svc.limits.max_tokens if svc.limits else None,
            "context": svc.limits.context if svc.limits else None,
            "max_body_bytes": svc.max_body_bytes,
        },
        **s.extra_info,
    }
    if svc.engine is not None:
        body["model_config"] = svc.engine.config.to_dict()
        tok = svc.engine.tokenizer
        body["tokenizer"] = {"name": tok.name, "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_id,
                             "eos_token_ids": sorted(svc.engine.eos_ids)}
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
        raise ApiError(413, f"request body exceeds {limit} bytes", code="payload_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", code="payload_too_large")
    return bytes(body)


async def completions(request: Request) -> Response:
    return await _generate(request, TEXT, lambda svc, raw: parse_completion(raw, svc.limits, svc.name, svc.prompt))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT,
                           lambda svc, raw: parse_chat(raw, svc.limits, svc.name, svc.prompt, svc.chat_template))


async def _generate(request: Request, shape: Shape, parse: Callable[[Service, bytes], CompletionRequest]) -> Response:
    svc = _service(request)
    svc.authorize(request)
    engine = svc.admitting_engine()
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "Content-Type must be application/json", code="unsupported_media_type")
    assert svc.limits is not None and svc.prompt is not None and svc.max_body_bytes is not None
    raw = await _read_body(request, svc.max_body_bytes)
    # JSON, validation, the chat template and the tokenizer take time that grows with the body: on a worker thread,
    # so /health and the other streams keep being served meanwhile (HFTokenizer encodes without holding the GIL).
    req = await run_in_threadpool(parse, svc, raw)
    access = request_fields(request.scope)  # token counts for the access log (never the prompt itself)
    access["prompt_tokens"] = len(req.prompt)

    events: asyncio.Queue[Output] = asyncio.Queue()
    seq = Sequence(req.prompt, req.max_tokens, req.sampling, req.stop, emit=svc.handoff.to(events),
                   stream=req.stream)
    try:
        engine.submit(seq)
    except QueueFull:
        raise ApiError(429, "server is at capacity; retry later", code="rate_limit_exceeded",
                       headers={"Retry-After": str(engine.retry_after())}) from None
    meta = {"id": f"{shape.id_prefix}{uuid.uuid4().hex}", "object": shape.object, "created": int(time.time()),
            "model": svc.name}
    if req.stream:
        chunk_meta = {**meta, "object": shape.chunk_object}
        return StreamingResponse(_sse(engine, seq, events, req, shape, chunk_meta, access),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, engine, seq, events, req, shape, meta, access)


def _usage(req: CompletionRequest, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(req.prompt) + completion_tokens}


def _engine_failure(ev: Output) -> ApiError:
    if ev.finish_reason == "abort":  # drain ran out of time
        return ApiError(503, f"request aborted: {ev.error}", code="unavailable")
    return ApiError(500, str(ev.error), code="internal_error")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _complete(request: Request, engine: Engine, seq: Sequence, events: asyncio.Queue[Output],
                    req: CompletionRequest, shape: Shape, meta: dict[str, Any], access: dict[str, Any]) -> Response:
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
    access.update(completion_tokens=ev.completion_tokens, finish_reason=ev.finish_reason)
    choice = shape.choice(ev.data, ev.finish_reason)
    return JSONResponse({**meta, "choices": [choice], "usage": _usage(req, ev.completion_tokens)})


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(engine: Engine, seq: Sequence, events: asyncio.Queue[Output], req: CompletionRequest,
               shape: Shape, meta: dict[str, Any], access: dict[str, Any]) -> AsyncIterator[str]:
    finished = False
    first = True
    try:
        while not finished:
            ev = await events.get()
            if ev.error:  # headers are gone already: report in-band, as OpenAI does, in the same error shape
                yield _sse_line(_engine_failure(ev).body())
                break
            finished = ev.finish_reason is not None
            access.update(completion_tokens=ev.completion_tokens, finish_reason=ev.finish_reason)
            if ev.data or finished:
                yield _sse_line({**meta, "choices": [shape.chunk(ev.data, ev.finish_reason, first)]})
                first = False
        if finished and req.include_usage:
            yield _sse_line({**meta, "choices": [], "usage": _usage(req, ev.completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.cancel(seq)
