"""The pure parts of serving: stop sequences, UTF-8-safe streaming, sampling, request validation, sd_notify."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from shardstack.serve.notify import Notifier
from shardstack.serve.protocol import ApiError, Limits, parse_completion
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


def test_parse_defaults_and_forms() -> None:
    req = parse_completion({"prompt": "hi"}, LIMITS, "m")
    assert (req.prompt, req.max_tokens, req.stream, req.stop) == ([104, 105], 16, False, [])
    assert req.sampling == SamplingParams(temperature=1.0, top_p=1.0, seed=None)
    assert parse_completion({"prompt": ["hi"], "model": "m", "stop": "x"}, LIMITS, "m").stop == [b"x"]
    assert parse_completion({"prompt": [1, 2, 255]}, LIMITS, "m").prompt == [1, 2, 255]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "max_tokens": 33}, "max_tokens"),
        ({"prompt": "x" * 64}, "prompt"),  # no room left to generate
        ({"prompt": "x" * 40, "max_tokens": 30}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_parse_rejects_with_the_field_named(body: dict, field: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(body, LIMITS, "m")
    assert (err.value.status, err.value.field) == (422, field)
    assert err.value.message.startswith(field)


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
