"""Property-based fuzzing of `POST /v1/completions` against the real running service (hypothesis).

Arbitrary JSON for every field of the schema, arbitrary field names (huge ones, lone UTF-16 surrogates), wrong
types and extreme floats, each sent at the same time as a well-formed request. Whatever comes in: never a 5xx,
never a dropped connection, every error in OpenAI's shape and bounded in size, and the neighbour completes with
its usual output. Derandomized with no example database, so every run (and CI) tries the same examples.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shardstack.serve.apierror import MAX_MESSAGE_CHARS, QUOTE_CHARS, ErrorBody
from shardstack.serve.protocol import CompletionBody

from .conftest import JSON

# The UTF-8 worst case of a bounded message and param, plus the JSON around them.
MAX_ERROR_BYTES = 4 * (MAX_MESSAGE_CHARS + QUOTE_CHARS) + 200
NEIGHBOUR = {"prompt": "a well-formed neighbour", "max_tokens": 8, "temperature": 0}



def mostly(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int) -> st.SearchStrategy:
    """`rare` once in `one_in` draws (st.one_of picks its branches evenly)."""
    return st.integers(1, one_in).flatmap(lambda k: rare if k == 1 else common)


# Text as a client can put it in JSON: any code point, lone surrogates included (json.dumps writes "\udXXX").
chars = mostly(st.characters(), st.characters(categories=["Cs"]), 8)
text = st.text(chars, max_size=24)
# Long strings: past any bound on what an error may quote, up to the test service's 64 KiB body limit (as JSON, an
# astral character takes 12 bytes, so the longest of them make bodies that get 413).
huge = st.builds(lambda c, n: c * n, chars, st.integers(65, 5000))
floats = st.floats() | st.sampled_from([1e-300, 5e-324, 1e-45, 1.1754943508222875e-38, 1.1754942e-38, 2.0,
                                        2.0000000000000004, -0.0, 1e308, 0.9999999999999999])
ints = st.integers() | st.sampled_from([0, 1, 63, 64, 65, 255, 256, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
                                        -(2**63) - 1, 10**300])
values = st.recursive(st.none() | st.booleans() | ints | floats | text,
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=4),
                      max_leaves=10)
anything = mostly(values, huge, 4)

# Per field: values near and inside its valid range (so requests get past validation and into the engine, where
# they share a batch with the neighbour), now and then anything at all.
FIELD_VALUES = {
    "prompt": text | st.lists(st.integers(-1, 300), max_size=8) | st.lists(text, max_size=2),
    "max_tokens": st.integers(-1, 66),
    "temperature": st.floats(-0.1, 2.1) | floats,
    "top_p": st.floats(-0.1, 1.1) | floats,
    "stop": text | st.lists(text, max_size=5),
    "seed": ints,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | values}),
    "model": st.sampled_from(["small", "gpt-9"]) | text,
}
FIELDS = sorted(CompletionBody.model_fields)
fields = st.lists(st.sampled_from(FIELDS), unique=True, max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: mostly(FIELD_VALUES.get(k, anything), anything, 4) for k in keys}))
unknown = mostly(st.just({}), st.dictionaries(mostly(text, huge, 3), anything, min_size=1, max_size=2), 4)
# A valid request with fields replaced and unknown ones added, or now and then any JSON value as the body.
requests = st.builds(lambda known, extra: {"prompt": "fuzz", "max_tokens": 4, **extra, **known}, fields, unknown)
bodies = mostly(requests, anything, 8)


def _post(client: httpx.Client, raw: bytes) -> tuple[int, str, bytes]:
    with client.stream("POST", "/v1/completions", headers=JSON, content=raw) as r:
        return r.status_code, r.headers.get("content-type", ""), r.read()


def _text(content_type: str, content: bytes) -> str:
    """The generated text of a 200, plain or streamed; a stream must end with [DONE] and carry no error."""
    if not content_type.startswith("text/event-stream"):
        body = json.loads(content)
        assert body["usage"]["completion_tokens"] >= 1
        return body["choices"][0]["text"]
    lines = [line for line in content.decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def neighbour_text(client: httpx.Client) -> str:
    status, content_type, content = _post(client, json.dumps(NEIGHBOUR).encode())
    assert status == 200
    return _text(content_type, content)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(body=bodies, neighbour_streams=st.booleans())
def test_any_request_gets_a_bounded_4xx_or_a_completion_and_never_hurts_a_neighbour(
        client: httpx.Client, neighbour_text: str, body: Any, neighbour_streams: bool) -> None:
    raw = json.dumps(body).encode()  # ASCII: non-ASCII and lone surrogates as \u escapes, NaN/Infinity as such
    neighbour = json.dumps({**NEIGHBOUR, "stream": neighbour_streams}).encode()
    with ThreadPoolExecutor(2) as pool:  # sent together, so a fuzzed request the engine admits shares its batch
        theirs = pool.submit(_post, client, neighbour)
        status, content_type, content = _post(client, raw)
        n_status, n_type, n_content = theirs.result()  # a dropped connection raises here or above

    event(f"status {status}")  # the mix shows in `pytest --hypothesis-show-statistics`
    assert status < 500, (status, content[:300])
    if status == 200:
        _text(content_type, content)
    else:
        assert len(content) <= MAX_ERROR_BYTES, (status, len(content))
        ErrorBody.model_validate_json(content)
    assert (n_status, _text(n_type, n_content)) == (200, neighbour_text)
