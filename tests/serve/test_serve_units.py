"""The pure parts of serving: stop sequences, UTF-8-safe streaming, sampling, request validation and the error
shape, sd_notify."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from shardstack.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from shardstack.serve.apierror import QUOTE_CHARS, ApiError, ErrorBody
from shardstack.serve.notify import Notifier
from shardstack.serve.protocol import Limits, PromptContext, default_body_limit, parse_completion
from shardstack.serve.sampling import SamplingParams, make_generator, sample
from shardstack.serve.text import UNBOUNDED_BYTES_PER_TOKEN, TextStream, max_input_bytes_per_token

from .conftest import CountingTokenizer

BYTES = ByteTokenizer()
CORPUS = Path(__file__).parents[2] / "runtime" / "shardstack" / "corpus" / "stdlib-docstrings.txt"


def _feed(tokenizer: Tokenizer, stops: list[str], ids: list[int]) -> tuple[list[str], bool]:
    """The deltas a TextStream releases for `ids`, and whether a stop ended it (as the engine drives it)."""
    stream, deltas = TextStream(tokenizer, stops), []
    for i in ids:
        delta, stopped = stream.push(i)
        deltas.append(delta)
        if stopped:
            return deltas, True
    delta, stopped = stream.finish()
    return [*deltas, delta], stopped


@pytest.mark.parametrize(
    ("stops", "generated", "expected", "stopped"),
    [
        ([], "hello world", "hello world", False),
        (["wor"], "hello world", "hello ", True),
        (["xyz"], "hello xy", "hello xy", False),  # a partial match is released at the end
        (["lo w", "o"], "hello world", "hell", True),  # the earliest completion wins
        (["ll", "hell"], "hello", "", True),  # both end at character 4; the longer one cuts earlier
        (["é"], "café au lait", "caf", True),  # a 2-byte stop: the cut falls between characters
        (["✓ d"], "ok ✓ done", "ok ", True),
    ],
)
def test_stop_sequences_on_text(stops: list[str], generated: str, expected: str, stopped: bool) -> None:
    deltas, hit = _feed(BYTES, stops, BYTES.encode(generated))
    assert ("".join(deltas), hit) == (expected, stopped)


def test_no_part_of_a_stop_string_is_ever_released() -> None:
    # Stop "éND" (3 characters, 4 bytes): the last 2 characters stay held, and the half of "é" is not even text yet.
    deltas, hit = _feed(BYTES, ["éND"], BYTES.encode("abcéND"))
    assert hit and deltas == ["", "", "a", "", "b", "c", ""]
    deltas, hit = _feed(BYTES, ["éND"], BYTES.encode("abcéNx"))  # no match: everything leaves at the end
    assert not hit and "".join(deltas) == "abcéNx" and deltas[-2:] == ["é", "Nx"]


@pytest.fixture(scope="module")
def bpe(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir)  # a byte-level BPE of 4096 tokens trained on the shipped corpus


def test_bpe_characters_split_across_tokens_are_released_whole(bpe: HFTokenizer) -> None:
    text = "naïve café ✓ 🚀 日本語, done"
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([i]) for i in ids), "no character of the text is split across tokens"
    deltas, hit = _feed(bpe, [], ids)
    assert not hit and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) and "" in deltas[:-1]  # a half character waits for its rest


def test_bpe_stop_sequence_across_token_boundaries(bpe: HFTokenizer) -> None:
    text = "Return the number of items in the list ✓ done."
    ids = bpe.encode(text)
    for stop, expected in (("er of it", "Return the numb"), ("✓", "Return the number of items in the list ")):
        assert all(stop not in bpe.decode([i]) for i in ids)  # no single token holds it: the match spans tokens
        deltas, hit = _feed(bpe, [stop, "never"], ids)
        assert (hit, "".join(deltas)) == (True, expected)


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_random_ids_release_the_full_decode_cut_at_the_first_stop(bpe: HFTokenizer, which: str) -> None:
    # Any ids a model may sample, broken UTF-8 included: the released text is decode(ids) up to the stop, whatever
    # the cuts between deltas.
    tok = BYTES if which == "bytes" else bpe
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, tok.vocab_size, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        full = tok.decode(ids)
        deltas, hit = _feed(tok, [], ids)
        assert ("".join(deltas), hit) == (full, False)
        start = int(torch.randint(0, len(full), (1,), generator=g))
        stop = full[start : start + 3]
        deltas, hit = _feed(tok, [stop], ids)
        assert ("".join(deltas), hit) == (full[: full.index(stop)], True)


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
BYTE_PROMPTS = PromptContext(BYTES, 256)


def _parse(body: object, prompt: PromptContext = BYTE_PROMPTS):  # as a client sends it: JSON text, non-ASCII
    return parse_completion(json.dumps(body).encode(), LIMITS, "m", prompt)  # escaped (lone surrogates as \udXXX)


def _rejection(body: object, raw: bytes | None = None, prompt: PromptContext = BYTE_PROMPTS) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_completion(json.dumps(body).encode() if raw is None else raw, LIMITS, "m", prompt)
    ErrorBody.model_validate(json.loads(err.value.json()))  # the one error shape, and always encodable
    return err.value


def test_parse_defaults_and_forms() -> None:
    req = _parse({"prompt": "hi"})
    assert (req.prompt, req.max_tokens, req.stream, req.stop) == ([104, 105], 16, False, [])
    assert req.sampling == SamplingParams(temperature=1.0, top_p=1.0, seed=None)
    assert _parse({"prompt": ["hi"], "model": "m", "stop": "x"}).stop == ["x"]
    assert _parse({"prompt": [1, 2, 255]}).prompt == [1, 2, 255]
    full = _parse({"prompt": "é", "max_tokens": 3, "temperature": 0, "top_p": 1, "seed": -1, "stream": True,
                   "stream_options": {"include_usage": True}, "stop": ["\u2603", "ab"], "user": "u", "n": 1,
                   "echo": False, "logprobs": None, "presence_penalty": 0.0})
    assert (full.prompt, full.max_tokens, full.stream, full.include_usage) == ([0xC3, 0xA9], 3, True, True)
    assert full.sampling == SamplingParams(temperature=0.0, top_p=1.0, seed=-1)
    assert full.stop == ["\u2603", "ab"]
    assert _parse({"prompt": "x", "top_p": 1.2e-38, "temperature": 1.2e-38}).sampling.top_p == 1.2e-38


def test_prompts_use_the_served_models_tokenizer_and_vocabulary(bpe: HFTokenizer) -> None:
    ctx = PromptContext(bpe, 4096)
    assert _parse({"prompt": "Return the value"}, ctx).prompt == bpe.encode("Return the value")
    assert len(bpe.encode("Return the value")) < len("Return the value")  # words, not bytes
    assert _parse({"prompt": [0, 4095]}, ctx).prompt == [0, 4095]
    err = _rejection({"prompt": [5, 4096]}, prompt=ctx)
    assert (err.param, err.message) == ("prompt", "prompt: token ids must be in [0, 4095] (the model's vocabulary)")
    assert _rejection({"prompt": [256]}).message == "prompt: token ids must be in [0, 255] (the model's vocabulary)"


def test_a_prompt_gets_the_bos_its_tokenizer_adds(bpe: HFTokenizer, bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    # Llama 3's tokenizer.json adds <|begin_of_text|> through its post-processor; ours has none (its model never saw
    # a BOS). The prompt follows the file, as transformers' tokenizers do.
    from tokenizers.processors import TemplateProcessing

    assert bpe.encode_prompt("hi") == bpe.encode("hi")
    edited = HFTokenizer(bpe_tokenizer_dir).tok
    edited.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((bpe_tokenizer_dir / name).read_bytes())
    edited.save(str(tmp_path / "tokenizer.json"))
    with_bos = HFTokenizer(tmp_path)
    assert with_bos.encode_prompt("hi") == [0, *bpe.encode("hi")]
    assert _parse({"prompt": "hi"}, PromptContext(with_bos, 4096)).prompt == [0, *bpe.encode("hi")]


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


def _edited(bpe_tokenizer_dir: Path, out: Path, edit) -> HFTokenizer:
    """The BPE tokenizer with its tokenizer.json's pipeline changed by `edit` (a function of the JSON)."""
    spec = json.loads((bpe_tokenizer_dir / "tokenizer.json").read_text())
    edit(spec)
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return HFTokenizer(out)


def test_bytes_per_token_bounds_what_one_token_stands_for(bpe: HFTokenizer, bpe_tokenizer_dir: Path,
                                                          tmp_path: Path) -> None:
    assert max_input_bytes_per_token(BYTES) == 1
    # Byte-level BPE: one character of a vocabulary entry is one byte ("Ġ" is the space).
    longest = max(len(t) for t in bpe.tok.get_vocab())
    assert max_input_bytes_per_token(bpe) == longest == 33
    corpus = CORPUS.read_text()
    texts = [corpus[i : i + 3000] for i in range(0, 60_000, 3000)]
    texts += [" " * 5000, "=" * 5000, " " + "=" * 4999, "\n" * 5000, "é🚀" * 500, "<|endoftext|>" * 100]
    for text in texts:  # the bound the size check relies on: N bytes are at least ceil(N / bound) tokens
        assert len(bpe.encode_prompt(text)) >= math.ceil(len(text.encode()) / longest), text[:40]

    def sentencepiece_like(spec: dict) -> None:  # Llama 2's: "▁" for spaces, byte fallback
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                              {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
        spec["model"].update(unk_token="<|endoftext|>", fuse_unk=True, byte_fallback=True)

    sp = _edited(bpe_tokenizer_dir, tmp_path / "sp", sentencepiece_like)
    assert max_input_bytes_per_token(sp) == max(len(t.encode()) for t in bpe.tok.get_vocab())  # UTF-8 bytes

    # Pipelines that can drop or shrink text give no bound from their vocabulary.
    for name, edit in [
        ("whitespace", lambda s: s.update(pre_tokenizer={"type": "Whitespace"})),
        ("nfkc", lambda s: s.update(normalizer={"type": "NFKC"})),
        ("strip", lambda s: s.update(normalizer={"type": "Sequence", "normalizers": [{"type": "Strip",
                                     "strip_left": True, "strip_right": True}]})),
        ("lstrip", lambda s: s["added_tokens"][0].update(lstrip=True)),
        ("fused unknown", lambda s: s["model"].update(unk_token="<|endoftext|>", fuse_unk=True)),
    ]:
        assert max_input_bytes_per_token(_edited(bpe_tokenizer_dir, tmp_path / name, edit)) == \
            UNBOUNDED_BYTES_PER_TOKEN, name


def test_an_oversize_text_prompt_is_refused_before_it_is_encoded(bpe_tokenizer_dir: Path) -> None:
    tok = CountingTokenizer(bpe_tokenizer_dir)
    ctx = PromptContext(tok, 4096)
    most = (LIMITS.context - 1) * ctx.bytes_per_token  # the longest text that could still fit: 63 tokens of 33
    for prompt in ("a" * (most + 1), ["a" * (most + 1)], "é" * (most // 2 + 1), "x" * 10**6):
        err = _rejection({"prompt": prompt}, prompt=ctx)
        assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
        assert err.message.startswith("prompt: ") and len(err.json()) < 400
    assert tok.calls == 0
    # At the bound the tokenizer decides (here: 2079 bytes of "a" are far more than 64 tokens).
    err = _rejection({"prompt": "a" * most}, prompt=ctx)
    assert (err.status, err.code, tok.calls) == (400, "context_length_exceeded", 1)
    assert _parse({"prompt": "hello"}, ctx).prompt == tok.encode("hello") and tok.calls == 2


def test_encoding_a_prompt_lets_other_threads_run(bpe: HFTokenizer) -> None:
    # tokenizers' Tokenizer.encode holds the GIL for the whole encoding (0.9 s for this text here, during which the
    # other thread got 2 turns, both before the encoding began); encode_prompt goes through the batch API, which
    # releases it (0.4 s, ~600 turns). Parsed on a worker thread, a long prompt then leaves the event loop running.
    text = CORPUS.read_text()[:200_000] * 5
    encoding, done, turns = threading.Event(), threading.Event(), []

    def other() -> None:
        while not done.is_set():
            if encoding.is_set():
                turns.append(1)
            time.sleep(0.0005)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        encoding.set()
        ids = bpe.encode_prompt(text)
        encoding.clear()
    finally:
        done.set()
        thread.join()
    assert ids == bpe.encode(text)
    assert len(turns) >= 20, len(turns)


@pytest.mark.parametrize("bytes_per_token", [1, 33, UNBOUNDED_BYTES_PER_TOKEN])
def test_the_default_body_limit_holds_any_prompt_that_fits(bytes_per_token: int) -> None:
    limit = default_body_limit(LIMITS.context, bytes_per_token)
    most = (LIMITS.context - 1) * bytes_per_token
    bodies = [
        {"prompt": "\x01" * most, "max_tokens": 1},  # 6 bytes of JSON per byte of text: the worst escaping
        {"prompt": "🚀" * (most // 4), "max_tokens": 1},  # ensure_ascii: a surrogate pair, 12 bytes per 4
        {"prompt": [4095] * (LIMITS.context - 1), "max_tokens": 1, "stop": ["x" * 64] * 4, "user": "u" * 1000},
    ]
    for body in bodies:
        assert len(json.dumps(body, indent=4).encode()) <= limit


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
                ApiError(503, "no inference replica is available; retry later", code="unavailable"),
                ApiError(404, "no such path at the load balancer: its API is /v1/* and /info", code="not_found"),
                ApiError(413, "request body too large", code="payload_too_large"),
                ApiError(401, "missing or invalid API key", code="invalid_api_key"),
                ApiError(429, "rate limit of this API key exceeded; retry later", code="rate_limit_exceeded"),
                ApiError(429, "too many requests in flight with this API key; retry later", code="rate_limit_exceeded"),
                ApiError(429, "too many concurrent connections from this client; retry later",
                         code="rate_limit_exceeded")):
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
