"""The pure parts of serving: stop sequences, UTF-8-safe streaming, sampling, request validation and the error
shape, sd_notify."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from shardstack.serve.notify import Notifier
from shardstack.serve.protocol import QUOTE_CHARS, ApiError, ErrorBody, Limits, parse_completion
from shardstack.serve.sampling import SamplingParams, make_generator, sample
from shardstack.serve.text import StopBuffer, decode, utf8_stream_decoder


def _feed(buf: StopBuffer, data: bytes) -> tuple[bytes, bool]:
    out = b""
    for byte in data:
        chunk, stopped = buf.push(byte)
        out += chunk
        if stopped:
            return out, True
    return out + buf.flush(), False


@pytest.mark.parametrize(
    ("stops", "generated", "expected", "stopped"),
    [
        ([], b"hello world", b"hello world", False),
        ([b"wor"], b"hello world", b"hello ", True),
        ([b"xyz"], b"hello xy", b"hello xy", False),  # a partial match is released at the end
        ([b"lo w", b"o"], b"hello world", b"hell", True),  # the earliest completion wins
        ([b"ll", b"hell"], b"hello", b"", True),  # both end at byte 4; the longer one cuts earlier
    ],
)
def test_stop_buffer(stops: list[bytes], generated: bytes, expected: bytes, stopped: bool) -> None:
    assert _feed(StopBuffer(stops), generated) == (expected, stopped)


def test_stop_buffer_never_releases_a_prefix_of_a_stop() -> None:
    buf = StopBuffer([b"END"])
    released = b""
    for byte in b"abcEN":
        released += buf.push(byte)[0]
    assert released == b"abc"  # "EN" is held back: it may still become "END"
    assert buf.push(ord("D")) == (b"", True)


def test_streamed_utf8_equals_one_shot_decode() -> None:
    # Multi-byte characters split across tokens, stray continuation bytes and a truncated sequence at the end.
    data = "héllo ✓ 🚀".encode() + b"\x80\xff" + "日本".encode() + b"\xe6\x97"
    decoder = utf8_stream_decoder()
    parts = [decoder.decode(bytes([b])) for b in data[:-1]] + [decoder.decode(data[-1:], final=True)]
    assert "".join(parts) == decode(data)
    assert "\ufffd" in decode(data)
    assert all("\ufffd" not in p for p in parts[:2])  # "h", then the half of "é" is held, not replaced


def test_greedy_and_tiny_top_p_pick_the_argmax() -> None:
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=1e-6)] * 2
    gens = [make_generator(i) for i in range(4)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_a_row_that_cannot_be_sampled_is_none_and_leaves_its_neighbours_alone() -> None:
    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    good = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    alone = [sample(logits[i : i + 1], good[i : i + 1], [make_generator(i)])[0] for i in range(6)]
    poisoned = logits.clone()
    poisoned[1, 17] = float("nan")  # a NaN row
    poisoned[3, 5] = float("inf")  # a row whose maximum is +inf
    params = list(good)
    params[4] = SamplingParams(top_p=1e-300, seed=4)  # positive in float64, 0 in float32: no mass is kept
    params[5] = SamplingParams(temperature=float("nan"), seed=5)
    got = sample(poisoned, params, [make_generator(i) for i in range(6)])
    assert got == [alone[0], None, alone[2], None, None, None]


def test_a_tiny_temperature_does_not_overflow() -> None:
    # logits / 1e-37 overflows float32 for |logits| > 34; shifted by the row maximum first it cannot.
    logits = torch.tensor([[300.0, 299.0, -300.0], [-50.0, 80.0, 79.0]])
    params = [SamplingParams(temperature=1e-37, seed=0), SamplingParams(temperature=1e-37, seed=1)]
    assert sample(logits, params, [make_generator(0), make_generator(1)]) == [0, 1]


def test_top_p_draws_only_from_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.75)] * 2000
    drawn = torch.tensor(sample(logits, params, [make_generator(i) for i in range(2000)]))
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 are cut
    assert 0.55 < (drawn == 0).float().mean() < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_seeded_draws_do_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    p = [SamplingParams(temperature=1.0, seed=7)] * 3
    alone = sample(logits[1:2], p[:1], [make_generator(7)])[0]
    gens = [make_generator(99), make_generator(7), make_generator(5)]
    assert sample(logits, p, gens)[1] == alone


LIMITS = Limits(context=64, max_tokens=32)


def _parse(body: object):  # as a client sends it: JSON text, non-ASCII escaped (lone surrogates become \udXXX)
    return parse_completion(json.dumps(body).encode(), LIMITS, "m")


def _rejection(body: object, raw: bytes | None = None) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_completion(json.dumps(body).encode() if raw is None else raw, LIMITS, "m")
    ErrorBody.model_validate(json.loads(err.value.json()))  # the one error shape, and always encodable
    return err.value


def test_parse_defaults_and_forms() -> None:
    req = _parse({"prompt": "hi"})
    assert (req.prompt, req.max_tokens, req.stream, req.stop) == ([104, 105], 16, False, [])
    assert req.sampling == SamplingParams(temperature=1.0, top_p=1.0, seed=None)
    assert _parse({"prompt": ["hi"], "model": "m", "stop": "x"}).stop == [b"x"]
    assert _parse({"prompt": [1, 2, 255]}).prompt == [1, 2, 255]
    full = _parse({"prompt": "é", "max_tokens": 3, "temperature": 0, "top_p": 1, "seed": -1, "stream": True,
                   "stream_options": {"include_usage": True}, "stop": ["\u2603", "ab"], "user": "u", "n": 1,
                   "echo": False, "logprobs": None, "presence_penalty": 0.0})
    assert (full.prompt, full.max_tokens, full.stream, full.include_usage) == ([0xC3, 0xA9], 3, True, True)
    assert full.sampling == SamplingParams(temperature=0.0, top_p=1.0, seed=-1)
    assert full.stop == ["\u2603".encode(), b"ab"]
    assert _parse({"prompt": "x", "top_p": 1.2e-38, "temperature": 1.2e-38}).sampling.top_p == 1.2e-38


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 33}, "max_tokens"),
        ({"prompt": "x" * 64}, "prompt"),  # no room left to generate
        ({"prompt": "x" * 40, "max_tokens": 30}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": ["é" * 33]}, "stop"),  # 66 bytes
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"prompt": "x", "user": 3}, "user"),
        # What float32 cannot honour: positive in float64, subnormal or 0 where sampling runs (on main, this
        # top_p made the sampler raise and failed every request batched with it).
        ({"prompt": "x", "top_p": 1e-300}, "top_p"),
        ({"prompt": "x", "top_p": 1e-40}, "top_p"),
        ({"prompt": "x", "temperature": 1e-300}, "temperature"),
    ],
)
def test_parse_rejects_with_the_param_named(body: dict, param: str) -> None:
    err = _rejection(body)
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(param + ": ")
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_context_overflow_has_openais_code() -> None:
    assert _rejection({"prompt": "x" * 64}).code == "context_length_exceeded"
    assert _rejection({"prompt": "x" * 40, "max_tokens": 30}).code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": ["ok \udfff"]}, "prompt"),
        ({"prompt": "x", "stop": "\udc00"}, "stop"),
        ({"prompt": "x", "stop": ["fine", "a\ud83d"]}, "stop"),
        ({"prompt": "x", "model": "\ud800"}, "model"),
        ({"prompt": "x", "user": "\udbff"}, "user"),
        ({"prompt": "x", "\ud800": 1}, None),  # a field name: rejected before any field is looked at
        ({"prompt": "x", "stream": True, "stream_options": {"\udc00": True}}, "stream_options"),
    ],
)
def test_lone_surrogates_are_a_clear_400(body: dict, param: str | None) -> None:
    err = _rejection(body)
    assert (err.status, err.param) == (400, param)
    assert "lone UTF-16 surrogate" in err.message and "not valid Unicode" in err.message


def test_unknown_fields_and_models_are_never_echoed_unbounded() -> None:
    key = "k" * 500_000
    err = _rejection({"prompt": "x", key: 1})
    assert err.param == "k" * (QUOTE_CHARS - 1) + "…"
    assert err.message == err.param + ": unknown field"
    assert len(err.json()) < 400
    err = _rejection({"prompt": "x", "stream": True, "stream_options": {"é" * 100_000: 1}})
    assert err.param == "stream_options." + "é" * (QUOTE_CHARS - 16) + "…"
    err = _rejection({"prompt": "x", "model": "m" * 100_000})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model") and len(err.json()) < 400
    err = _rejection({"prompt": "x", "max_tokens": 10**4000})
    assert err.param == "max_tokens" and len(err.json()) < 400


@pytest.mark.parametrize(
    "raw",
    [b"", b"  ", b'{"prompt": ', b'["hi"]', b'"hi"', b'{"prompt": "\xff\xfe"}', b"[" * 20000 + b"]" * 20000,
     '{"prompt": "UTF-16"}'.encode("utf-16"), b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"],
)
def test_bodies_that_are_not_a_json_object(raw: bytes) -> None:
    err = _rejection(None, raw)
    assert (err.status, err.param, err.code) == (400, None, "invalid_json")
    assert len(err.json()) < 400


def test_error_body_is_openais_shape() -> None:
    err = ApiError(429, "busy", code="rate_limit_exceeded", headers={"Retry-After": "3"})
    assert json.loads(err.json()) == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                                "code": "rate_limit_exceeded"}}
    assert ApiError(401, "no").body()["error"]["type"] == "authentication_error"
    assert ApiError(503, "no").body()["error"]["type"] == "server_error"
    assert ApiError(404, "no").body()["error"]["type"] == "invalid_request_error"
    # Whatever goes into a message, the body encodes and stays bounded.
    assert len(ApiError(500, "\ud800" * 10**6).json()) < 4 * 512 + 100


def test_the_load_balancers_error_bodies_in_the_docs_are_the_services_shape() -> None:
    # The loadbalancer role writes HAProxy's own 429/503 bodies from docs/serving.md; they must be exactly these.
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for err in (ApiError(429, "rate limit exceeded; retry later", code="rate_limit_exceeded"),
                ApiError(503, "no inference replica is available; retry later", code="unavailable")):
        assert f"`{err.json().decode()}`" in docs


def test_notifier_sends_datagrams_to_notify_socket(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2)
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
        n = Notifier(env)
        assert n.enabled and n.watchdog_seconds == 2.0
        assert n.ready("serving m") and n.watchdog() and n.stopping("draining")
        got = [sock.recv(4096).decode().splitlines() for _ in range(3)]
    assert got[0][:2] == ["READY=1", "STATUS=serving m"]
    assert got[1] == ["WATCHDOG=1"]
    assert got[2] == ["STOPPING=1", "STATUS=draining"]


def test_notifier_abstract_socket_and_watchdog_for_another_pid() -> None:
    name = f"shardstack-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
        assert n.watchdog_seconds is None  # the watchdog is meant for another process
        assert n.status("x")
        assert sock.recv(100) == b"STATUS=x"
    assert not Notifier({}).ready("x")  # not under systemd: a no-op
