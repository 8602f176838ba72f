"""The service over a Llama with a byte-level BPE tokenizer, served from a Hugging Face directory: /info, text and
token-id prompts, streamed text equal to non-streamed text where characters span tokens, stop sequences matched
across token boundaries, and the model's EOS tokens."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from shardstack.model.tokenizer import HFTokenizer

from .conftest import AUTH, EOS_AT, EOS_PROMPT, Service, greedy_ids


@pytest.fixture(scope="module")
def bpe(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir)


def _complete(client: httpx.Client, body: dict) -> dict:
    r = client.post("/v1/completions", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client: httpx.Client, body: dict) -> tuple[list[str], str | None]:
    """The text deltas of a streamed completion and its finish reason."""
    with client.stream("POST", "/v1/completions", headers=AUTH, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    return [c["text"] for c in chunks], chunks[-1]["finish_reason"]


def test_info_reports_the_tokenizer_and_the_architecture(bpe_svc: Service, bpe_client: httpx.Client,
                                                         bpe: HFTokenizer) -> None:
    info = bpe_client.get("/info", headers=AUTH).json()
    assert (info["arch"], info["format"], info["model"]) == ("llama", "hf", "small")
    tok = info["tokenizer"]
    assert (tok["name"], tok["vocab_size"], tok["bos_token_id"]) == (bpe.name, 4096, 0)
    assert tok["eos_token_ids"][0] == 0 and len(tok["eos_token_ids"]) == 2  # <|endoftext|> + generation_config's
    assert info["model_config"]["n_kv_head"] == 2 and info["limits"]["context"] == 256
    assert "tokenizer tokenizer.json:" in bpe_svc.log()  # the start-up line names it too
    # Served from the copy it verified against the signed manifest (model.manifest), with the key it names.
    key_id = info["signed_by"]
    assert isinstance(key_id, str) and len(key_id) == 16
    assert f"signed with key id {key_id}" in bpe_svc.log()
    assert info["step"] == 0  # a Hugging Face directory has none of its own: the signed manifest's


def test_a_text_prompt_and_its_token_ids_give_the_same_completion(bpe_client: httpx.Client, bpe: HFTokenizer) -> None:
    text = "Return a new list of the items ✓ in order"
    ids = bpe.encode_prompt(text)
    assert len(ids) < len(text.encode())  # BPE tokens, not bytes
    body = {"max_tokens": 12, "temperature": 0}
    by_text, by_ids = _complete(bpe_client, {**body, "prompt": text}), _complete(bpe_client, {**body, "prompt": ids})
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_text["usage"]["prompt_tokens"] == by_ids["usage"]["prompt_tokens"] == len(ids)
    r = bpe_client.post("/v1/completions", headers=AUTH, json={"prompt": [17, 4096]})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "prompt: token ids must be in [0, 4095] (the model's vocabulary)"


def test_streamed_text_equals_the_text_where_characters_span_tokens(bpe_client: httpx.Client) -> None:
    # Sampled from random weights: the 4096 tokens include the 128 bytes that only ever form part of a character,
    # so these completions hold characters split across tokens and broken sequences (U+FFFD) alike.
    texts = []
    for seed in range(6):
        body = {"prompt": "Über die Brücke", "max_tokens": 48, "temperature": 1.0, "seed": seed}
        plain = _complete(bpe_client, body)["choices"][0]
        deltas, finish = _stream(bpe_client, body)
        assert ("".join(deltas), finish) == (plain["text"], plain["finish_reason"])
        assert plain["finish_reason"] in ("length", "stop")  # 48 tokens, or a sampled EOS before them
        texts.append(plain["text"])
    joined = "".join(texts)
    # Byte tokens of non-ASCII characters were sampled (as U+FFFD when they form no character, or as the character);
    # whole characters built from byte tokens are checked deterministically in test_serve_units.py.
    assert any(ord(c) > 127 for c in joined), "no token of a non-ASCII byte was generated"


def test_a_stop_sequence_spanning_tokens_cuts_the_text_before_it(bpe_client: httpx.Client, bpe: HFTokenizer) -> None:
    body = {"prompt": "The file object", "max_tokens": 48, "temperature": 1.0, "seed": 3}
    full = _complete(bpe_client, body)["choices"][0]["text"]
    vocab = [bpe.decode([i]) for i in range(bpe.vocab_size)]
    # A stop that no single token holds, taken from the middle of the text: wherever it matches, it spans tokens.
    stop = next(full[i : i + 3] for i in range(len(full) // 3, len(full) - 3)
                if "\ufffd" not in full[i : i + 3] and not any(full[i : i + 3] in v for v in vocab))
    expected = full[: full.index(stop)]
    plain = _complete(bpe_client, {**body, "stop": [stop, "never generated"]})["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (expected, "stop")
    deltas, finish = _stream(bpe_client, {**body, "stop": stop})
    assert ("".join(deltas), finish) == (expected, "stop")


def test_the_models_eos_ends_the_completion_with_stop(bpe_model_dir, bpe_client: httpx.Client,
                                                      bpe: HFTokenizer) -> None:
    ids = greedy_ids(bpe_model_dir, bpe.encode_prompt(EOS_PROMPT), EOS_AT)  # the last one is an EOS of the model
    body = {"prompt": EOS_PROMPT, "max_tokens": 32, "temperature": 0}
    plain = _complete(bpe_client, body)
    assert (plain["choices"][0]["text"], plain["choices"][0]["finish_reason"]) == (bpe.decode(ids[:-1]), "stop")
    assert plain["usage"]["completion_tokens"] == EOS_AT
    deltas, finish = _stream(bpe_client, body)
    assert ("".join(deltas), finish) == (bpe.decode(ids[:-1]), "stop")
