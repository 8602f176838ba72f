"""The HTTP API against a real `shardstack serve` process: the malformed-request table (every error in OpenAI's
shape), a rejected request next to good ones, auth, streaming vs non-streaming, stop sequences, batching of
concurrent requests, /info, /health and /metrics."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from shardstack.serve.apierror import ErrorBody

from .conftest import AUTH, JSON, Service


def _metric(client: httpx.Client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ready_after_load_and_warm_up(svc: Service, client: httpx.Client) -> None:
    # /health answered 503 "loading" while the model loaded, and READY=1 came only once it was ready.
    assert (503, "loading") in svc.health_seen
    assert (200, "ok") not in svc.health_seen[: svc.health_seen.index((503, "loading")) + 1]
    assert svc.notify.count("READY") == 1
    assert client.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    info = client.get("/info", headers=AUTH).json()
    assert info["model"] == "small" and info["engine"] == "builtin" and info["step"] == 0 and info["dtype"] == "float32"
    assert info["checkpoint"] == "random:gpt:small:seed=1234" and info["device"] == "cpu"
    assert (info["arch"], info["format"], info["signed_by"]) == ("gpt", "shardstack", None)  # --allow-unsigned
    assert info["tokenizer"] == {"name": "bytes", "vocab_size": 256, "bos_token_id": None, "eos_token_ids": []}
    assert info["limits"] == {"max_concurrency": 8, "max_queue": 32, "max_tokens": 64, "context": 256,
                              "max_body_bytes": 65536}
    assert info["model_config"]["n_layer"] == 4


# (name, method, path, headers, raw body, expected status, `param` of the error)
MALFORMED = [
    ("bad json", "POST", "/v1/completions", JSON, b'{"prompt": ', 400, None),
    ("empty body", "POST", "/v1/completions", JSON, b"", 400, None),
    ("not an object", "POST", "/v1/completions", JSON, b'["hi"]', 400, None),
    ("invalid utf-8", "POST", "/v1/completions", JSON, b'{"prompt": "\xff\xfe"}', 400, None),
    ("deeply nested", "POST", "/v1/completions", JSON, b"[" * 20000 + b"]" * 20000, 400, None),
    ("missing prompt", "POST", "/v1/completions", JSON, b'{"max_tokens": 4}', 400, "prompt"),
    ("prompt wrong type", "POST", "/v1/completions", JSON, b'{"prompt": 42}', 400, "prompt"),
    ("prompt empty", "POST", "/v1/completions", JSON, b'{"prompt": ""}', 400, "prompt"),
    ("token id out of range", "POST", "/v1/completions", JSON, b'{"prompt": [72, 300]}', 400, "prompt"),
    ("prompt longer than context", "POST", "/v1/completions", JSON,
     json.dumps({"prompt": "x" * 300}).encode(), 400, "prompt"),
    ("prompt + max_tokens over context", "POST", "/v1/completions", JSON,
     json.dumps({"prompt": "x" * 250, "max_tokens": 10}).encode(), 400, "max_tokens"),
    ("max_tokens string", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": "5"}', 400,
     "max_tokens"),
    ("max_tokens negative", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": -1}', 400,
     "max_tokens"),
    ("max_tokens zero", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    ("max_tokens huge", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": 1000000000000}', 400,
     "max_tokens"),
    ("max_tokens bool", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": true}', 400,
     "max_tokens"),
    ("max_tokens float", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_tokens": 2.5}', 400, "max_tokens"),
    ("temperature string", "POST", "/v1/completions", JSON, b'{"prompt": "a", "temperature": "hot"}', 400,
     "temperature"),
    ("temperature negative", "POST", "/v1/completions", JSON, b'{"prompt": "a", "temperature": -0.5}', 400,
     "temperature"),
    ("temperature NaN", "POST", "/v1/completions", JSON, b'{"prompt": "a", "temperature": NaN}', 400,
     "temperature"),
    ("temperature below float32", "POST", "/v1/completions", JSON, b'{"prompt": "a", "temperature": 1e-300}', 400,
     "temperature"),
    ("top_p zero", "POST", "/v1/completions", JSON, b'{"prompt": "a", "top_p": 0}', 400, "top_p"),
    ("top_p above one", "POST", "/v1/completions", JSON, b'{"prompt": "a", "top_p": 1.5}', 400, "top_p"),
    ("top_p 0 in float32", "POST", "/v1/completions", JSON, b'{"prompt": "a", "top_p": 1e-300}', 400, "top_p"),
    ("stop wrong type", "POST", "/v1/completions", JSON, b'{"prompt": "a", "stop": 5}', 400, "stop"),
    ("too many stops", "POST", "/v1/completions", JSON, b'{"prompt": "a", "stop": ["a","b","c","d","e"]}', 400,
     "stop"),
    ("seed string", "POST", "/v1/completions", JSON, b'{"prompt": "a", "seed": "x"}', 400, "seed"),
    ("stream string", "POST", "/v1/completions", JSON, b'{"prompt": "a", "stream": "yes"}', 400, "stream"),
    ("n > 1", "POST", "/v1/completions", JSON, b'{"prompt": "a", "n": 2}', 400, "n"),
    ("unknown field", "POST", "/v1/completions", JSON, b'{"prompt": "a", "max_token": 5}', 400, "max_token"),
    ("huge unknown field", "POST", "/v1/completions", JSON, json.dumps({"prompt": "a", "k" * 60_000: 1}).encode(),
     400, "k" * 63 + "…"),
    ("surrogate in prompt", "POST", "/v1/completions", JSON, b'{"prompt": "a\\ud800"}', 400, "prompt"),
    ("surrogate in stop", "POST", "/v1/completions", JSON, b'{"prompt": "a", "stop": ["\\udc00"]}', 400, "stop"),
    ("surrogate in a field name", "POST", "/v1/completions", JSON, b'{"prompt": "a", "\\ud800": 1}', 400, None),
    ("unknown model", "POST", "/v1/completions", JSON, b'{"prompt": "a", "model": "gpt-9"}', 404, "model"),
    ("huge prompt", "POST", "/v1/completions", JSON, json.dumps({"prompt": "x" * 100_000}).encode(), 413, None),
    ("wrong content type", "POST", "/v1/completions", {**AUTH, "Content-Type": "text/plain"}, b'{"prompt": "a"}',
     415, None),
    ("no content type", "POST", "/v1/completions", AUTH, b'{"prompt": "a"}', 415, None),
    ("missing token", "POST", "/v1/completions", {"Content-Type": "application/json"}, b'{"prompt": "a"}', 401,
     None),
    ("wrong token", "POST", "/v1/completions", {"Authorization": "Bearer nope", "Content-Type": "application/json"},
     b'{"prompt": "a"}', 401, None),
    ("info without token", "GET", "/info", {}, b"", 401, None),
    ("wrong method", "GET", "/v1/completions", AUTH, b"", 405, None),
    ("unknown path", "POST", "/v1/chat/nothing", JSON, b"{}", 404, None),
    ("huge unknown path", "GET", "/v1/" + "p" * 8000, JSON, b"", 404, None),
]


def test_malformed_requests_get_the_right_4xx_in_openais_shape_and_service_keeps_serving(
        client: httpx.Client) -> None:
    before_5xx = sum(_metric(client, f'shardstack_infer_requests_total{{api_key="-",code="{c}"}}')
                     for c in (500, 502, 503))
    failures = []
    for name, method, path, headers, body, status, param in MALFORMED:
        r = client.request(method, path, headers=headers, content=body)
        try:
            err = ErrorBody.model_validate_json(r.content).error
        except ValueError as exc:
            failures.append(f"{name}: {r.status_code}, not the error shape: {exc}")
            continue
        ok = r.status_code == status and err.param == param and len(r.content) < 1024
        ok = ok and err.type == ("authentication_error" if status == 401 else "invalid_request_error")
        if param is not None:
            ok = ok and err.message.startswith(param if status != 404 else "model ")
        if status == 401:
            ok = ok and r.headers.get("www-authenticate") == "Bearer"
        if not ok:
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    # Still serving, and nothing above was counted as a server error.
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "still there?", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    after_5xx = sum(_metric(client, f'shardstack_infer_requests_total{{api_key="-",code="{c}"}}')
                    for c in (500, 502, 503))
    assert after_5xx == before_5xx
    assert _metric(client, 'shardstack_infer_requests_total{api_key="-",code="400"}') >= 30
    assert client.get("/health").status_code == 200


def _send(client: httpx.Client, body: dict, stream: bool) -> tuple[int, str | dict]:
    """(status, generated text) for a 200, else (status, the error object)."""
    if not stream:
        r = client.post("/v1/completions", headers=AUTH, json=body)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()["error"]
    with client.stream("POST", "/v1/completions", headers=AUTH, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()["error"]
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return 200, "".join(c["choices"][0]["text"] for c in chunks)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_poisoned_request_does_not_fail_its_neighbours(client: httpx.Client, stream: bool) -> None:
    # On main, a top_p that is 0 in float32 reached the sampler and every request batched with it got a 500.
    good = [{"prompt": f"neighbour {i}", "max_tokens": 32, "temperature": 0.9, "seed": i} for i in range(5)]
    expected = [_send(client, b, stream=False) for b in good]
    poisoned = {"prompt": "poison", "max_tokens": 32, "temperature": 1.0, "top_p": 1e-300}
    bodies = [*good[:2], poisoned, *good[2:]]
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: _send(client, b, stream), bodies))
    status, err = results.pop(2)
    assert status == 400 and isinstance(err, dict) and err["param"] == "top_p", err
    assert results == expected and all(code == 200 for code, _ in expected)


def _stream(client: httpx.Client, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with client.stream("POST", "/v1/completions", headers=AUTH, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks


@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "seed": 42}, {"temperature": 0.7, "top_p": 0.8,
                                                                         "seed": 7}, {"temperature": 0}])
def test_streaming_returns_the_same_text_as_non_streaming(client: httpx.Client, sampling: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 48, **sampling}
    plain = client.post("/v1/completions", headers=AUTH, json=body).json()
    text, chunks = _stream(client, {**body, "stream_options": {"include_usage": True}})
    assert text == plain["choices"][0]["text"] and len(text) > 0
    assert plain["choices"][0]["finish_reason"] == chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == plain["usage"] == {"prompt_tokens": 16, "completion_tokens": 48,
                                                      "total_tokens": 64}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert plain["object"] == "text_completion" and plain["id"].startswith("cmpl-")
    # Seeded: the same request again gives the same text.
    assert client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"] == text


def test_stop_sequence_truncates_and_reports_stop(client: httpx.Client) -> None:
    body = {"prompt": "Stop me", "max_tokens": 64, "temperature": 1.0, "seed": 5}
    full = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    # An ASCII character from the middle of the output (ASCII bytes never sit inside a UTF-8 sequence).
    stop = next((c for c in full[len(full) // 2 :] if ord(c) < 128 and c != "\ufffd"), None)
    assert stop is not None, f"no ASCII character in the sampled output to stop on: {full!r}"
    expected = full[: full.index(stop)]
    r = client.post("/v1/completions", headers=AUTH, json={**body, "stop": [stop, "\u2603"]}).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (expected, "stop")
    text, chunks = _stream(client, {**body, "stop": stop})
    assert text == expected and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_are_batched_and_match_sequential_results(client: httpx.Client) -> None:
    bodies = [{"prompt": f"request number {i}", "max_tokens": 40, "temperature": 0.0 if i % 2 else 0.9,
               "seed": i} for i in range(8)]
    sequential = [client.post("/v1/completions", headers=AUTH, json=b).json()["choices"][0]["text"] for b in bodies]
    steps_before = _metric(client, "shardstack_infer_engine_steps_total")
    batched_before = _metric(client, "shardstack_infer_batch_size_count") - _metric(
        client, 'shardstack_infer_batch_size_bucket{le="1.0"}')
    # Released together: threads that a loaded host starts one by one must not spread the 8 over their decoding.
    barrier = threading.Barrier(8)

    def fire(body: dict) -> dict:
        barrier.wait()
        return client.post("/v1/completions", headers=AUTH, json=body).json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(fire, bodies))
    assert [r["choices"][0]["text"] for r in results] == sequential
    steps = _metric(client, "shardstack_infer_engine_steps_total") - steps_before
    batched = _metric(client, "shardstack_infer_batch_size_count") - _metric(
        client, 'shardstack_infer_batch_size_bucket{le="1.0"}') - batched_before
    assert steps < 8 * 40 / 2, f"{steps} engine steps for 8x40 tokens: requests were not batched"
    assert batched > 0


def test_metrics_expose_the_documented_names(client: httpx.Client) -> None:
    client.post("/v1/completions", headers=AUTH, json={"prompt": "count me", "max_tokens": 5})
    text = client.get("/metrics").text
    for name in ("shardstack_infer_request_duration_seconds_bucket", "shardstack_infer_time_to_first_token_seconds_"
                 "bucket", "shardstack_infer_requests_running", "shardstack_infer_requests_waiting",
                 'shardstack_infer_requests_total{api_key="-",code="200"}', "shardstack_infer_prompt_tokens_total",
                 "shardstack_infer_generation_tokens_total", "shardstack_infer_engine_heartbeat_timestamp_seconds",
                 "shardstack_infer_ready 1.0"):
        assert name in text, name
    assert _metric(client, "shardstack_infer_generation_tokens_total") >= 5
    assert _metric(client, "shardstack_infer_request_duration_seconds_count") >= 1
    models = client.get("/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["small"]
