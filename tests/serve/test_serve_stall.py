"""Serving that one client cannot stall, against the app under uvicorn in this process (so the service can be handed
a tokenizer that counts its encodings and, for one test, holds them): a text prompt too long in bytes to fit the
context is refused without being encoded, a body over the limit gets 413 while it is read, and while a large
prompt is being encoded, /health and another client's stream are answered (requests are parsed off the event
loop). Ordering, not timing: a held encoding waits for the test's go."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from shardstack.serve.apierror import ErrorBody
from shardstack.serve.app import create_app
from shardstack.serve.lifecycle import Service
from shardstack.serve.protocol import PromptContext, default_body_limit
from shardstack.serve.settings import ServeSettings

from .conftest import READY_TIMEOUT, CountingTokenizer

HOLD_SECONDS = 60.0  # how long a held encoding waits for the go: a ceiling, reached only when the test fails
CORPUS = Path(__file__).parents[2] / "runtime" / "shardstack" / "corpus" / "stdlib-docstrings.txt"


class HeldTokenizer(CountingTokenizer):
    """Encodes a prompt of at least `hold_bytes` only once the test says go, logging when that encoding starts and
    ends: an encoding as slow as the test needs, with nothing timed."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.hold_bytes: int | None = None
        self.events: list[str] = []
        self.started = threading.Event()
        self.go = threading.Event()

    def encode_prompt(self, text: str) -> list[int]:
        if self.hold_bytes is None or len(text.encode()) < self.hold_bytes:
            return super().encode_prompt(text)
        self.events.append("encode start")
        self.started.set()
        self.go.wait(HOLD_SECONDS)
        ids = super().encode_prompt(text)
        self.events.append("encode end")
        return ids


@pytest.fixture(scope="module")
def served(bpe_model_dir: Path) -> Iterator[tuple[str, Service, HeldTokenizer]]:
    """The BPE Llama served on a free loopback port with no --max-body-bytes (the limit is derived), validating
    prompts with a HeldTokenizer."""
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = Service(ServeSettings(model_dir=bpe_model_dir, model_name="small", device="cpu", dtype="float32",
                                    max_concurrency=4, access_log="off"))
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + READY_TIMEOUT
    while not (server.started and service.phase == "ready"):
        assert service.phase != "failed", service.failure
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    assert service.prompt is not None
    tok = HeldTokenizer(bpe_model_dir)
    service.prompt = PromptContext(tok, service.prompt.vocab_size)  # what the routes validate prompts with
    try:
        yield f"http://127.0.0.1:{port}", service, tok
    finally:
        tok.go.set()
        server.should_exit = True
        thread.join(30)


def _error(r: httpx.Response) -> tuple[int, str | None, str | None]:
    err = ErrorBody.model_validate_json(r.content).error
    return r.status_code, err.param, err.code


def test_oversize_prompts_and_bodies_are_refused_before_any_encoding(
        served: tuple[str, Service, HeldTokenizer]) -> None:
    url, service, tok = served
    assert service.limits is not None and service.prompt is not None
    context, per_token = service.limits.context, service.prompt.bytes_per_token
    assert per_token == 33  # the longest token of this byte-level BPE
    assert service.max_body_bytes == default_body_limit(context, per_token)  # derived: none was set
    most = (context - 1) * per_token  # the longest text prompt that could fit, in bytes
    calls = tok.calls
    too_big = b'{"prompt": "' + b"a" * service.max_body_bytes + b'"}'
    with httpx.Client(base_url=url, timeout=60) as c:
        for prompt in ("a" * (most + 1), ["é" * (most // 2 + 1)]):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert _error(r) == (400, "prompt", "context_length_exceeded"), r.text
        r = c.post("/v1/completions", content=too_big, headers={"Content-Type": "application/json"})
        assert _error(r) == (413, None, "payload_too_large")  # refused on its Content-Length
        chunks = (too_big[i : i + 16384] for i in range(0, len(too_big), 16384))  # no Content-Length: chunked
        r = c.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"})
        assert _error(r) == (413, None, "payload_too_large")  # refused while it was read
        assert tok.calls == calls  # none of them reached the tokenizer
        r = c.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
        assert r.status_code == 200 and tok.calls == calls + 1
        assert c.get("/info").json()["limits"]["max_body_bytes"] == service.max_body_bytes


def test_health_and_other_streams_answer_while_a_large_prompt_is_encoded(
        served: tuple[str, Service, HeldTokenizer]) -> None:
    url, service, tok = served
    assert service.limits is not None
    # Large but allowed: as much of the corpus as leaves room for max_tokens in the context.
    words, text = CORPUS.read_text().split(" "), ""
    for word in words:
        if len(tok.encode(text + word + " ")) > service.limits.context - 9:
            break
        text += word + " "
    body = {"prompt": text, "max_tokens": 8, "temperature": 0}
    tok.events.clear()
    tok.hold_bytes = len(text.encode())
    try:
        with httpx.Client(base_url=url, timeout=2 * HOLD_SECONDS) as c, ThreadPoolExecutor(1) as pool:
            for _ in range(3):  # one client sending the large prompt again and again
                tok.started.clear()
                tok.go.clear()
                sent = pool.submit(c.post, "/v1/completions", json=body)
                assert tok.started.wait(HOLD_SECONDS)
                # Parsed on the event loop, the encoding would keep both from being answered until the go.
                tok.events.append(f"health {c.get('/health').status_code}")
                meanwhile = {"prompt": "meanwhile", "max_tokens": 4, "stream": True}
                with c.stream("POST", "/v1/completions", json=meanwhile) as stream:
                    lines = [line for line in stream.iter_lines() if line]
                tok.events.append(f"stream {stream.status_code} {lines[-1]}")
                tok.go.set()
                r = sent.result()
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(text))
    finally:
        tok.hold_bytes = None
        tok.go.set()
    assert len(text.encode()) > 500
    assert tok.events == ["encode start", "health 200", "stream 200 data: [DONE]", "encode end"] * 3
