"""The access log as structured journal fields: the real service, its journal sink pointed at a unix datagram
socket this test binds (tests/journal_socket.py; journald's native socket is one too), requests that succeed,
stream, fail auth, miss a route or are malformed; each is one datagram with the documented fields and none holds
the token or a prompt. In process: one observation of each response feeds both the access log and the metrics."""

from __future__ import annotations

import logging
import re
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from journal_socket import JournalSocket
from shardstack.serve.accesslog import AccessLog, decode_entry, encode_entry, resolve_mode
from shardstack.serve.app import ObserveResponses
from shardstack.serve.metrics import ServeMetrics
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from .conftest import AUTH, JSON, TOKEN, Service, running_service

PROMPT = "the-secret-prompt-words"
WRONG_TOKEN = "wrong-token-value"
HAPROXY_ID = "7F000001:D090_7F000001:4A2F_6B0EEDFD_0000:5364"  # what the load balancer's unique-id-format makes


@pytest.fixture(scope="module")
def journaled(model_dir: Path) -> Iterator[tuple[Service, JournalSocket]]:
    with tempfile.TemporaryDirectory(prefix="ss-") as tmp:
        journal = JournalSocket(Path(tmp) / "journal.sock")
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN + "\n")
        with running_service(model_dir, Path(tmp), "--token-file", str(token_file), "--max-tokens", "16",
                             "--access-log", "journal", "--journal-socket", str(journal.path)) as svc:
            journal.raw.clear()  # the /health polls while it loaded (503: logged, as failing probes are)
            yield svc, journal
        journal.close()


def test_each_request_is_one_entry_with_fields_and_no_secret(journaled: tuple[Service, JournalSocket]) -> None:
    svc, journal = journaled
    body = {"model": "small", "prompt": PROMPT, "max_tokens": 5}
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        ok = c.post("/v1/completions", headers={**JSON, "X-Request-ID": HAPROXY_ID}, json=body)
        # The load balancer names the API key a request came with; a name that is not one is "-".
        streamed = c.post("/v1/completions", headers={**JSON, "X-Shardstack-Client": "team-a"},
                          json={**body, "stream": True, "stream_options": {"include_usage": True}})
        denied = c.post("/v1/completions", headers={"Authorization": f"Bearer {WRONG_TOKEN}",
                                                    "Content-Type": "application/json",
                                                    "X-Shardstack-Client": "Not A Name!"}, json=body)
        missing = c.get("/no/such/path?api_key=" + TOKEN, headers=AUTH)
        malformed = c.post("/v1/completions", headers={**JSON, "X-Request-ID": "bad id\twith junk"},
                           content=b'{"prompt": ')
        health = c.get("/health")
        # Logged (a 404), sent after the probe was answered: once its entry is in, the probe's would be too.
        marker = c.get("/after/the/probe", headers=AUTH)
    assert [r.status_code for r in (ok, streamed, denied, missing, malformed, health, marker)] == \
        [200, 200, 401, 404, 400, 200, 404]

    # The caller's (HAProxy's) request id when well-formed, else a fresh one; the response carries it.
    assert ok.headers["x-request-id"] == HAPROXY_ID
    assert malformed.headers["x-request-id"] != "bad id\twith junk"
    e = journal.entry("SHARDSTACK_REQUEST_ID", HAPROXY_ID)
    usage = ok.json()["usage"]
    assert e["SHARDSTACK_METHOD"] == "POST" and e["SHARDSTACK_PATH"] == "/v1/completions"
    assert e["SHARDSTACK_STATUS"] == "200" and e["SHARDSTACK_CLIENT"] == "127.0.0.1"
    assert e["SHARDSTACK_PROMPT_TOKENS"] == str(usage["prompt_tokens"])
    assert e["SHARDSTACK_COMPLETION_TOKENS"] == str(usage["completion_tokens"])
    assert e["SHARDSTACK_RESPONSE_BYTES"] == str(len(ok.content))
    assert float(e["SHARDSTACK_DURATION_MS"]) > 0
    assert e["SYSLOG_IDENTIFIER"] == "shardstack-inference" and e["PRIORITY"] == "6"
    assert e["MESSAGE"].startswith('127.0.0.1 "POST /v1/completions" 200 ') and f"id={HAPROXY_ID}" in e["MESSAGE"]

    e = journal.entry("SHARDSTACK_REQUEST_ID", streamed.headers["x-request-id"])
    last_usage = [line for line in streamed.text.splitlines() if '"usage"' in line][-1]
    assert e["SHARDSTACK_STATUS"] == "200" and f'"completion_tokens": {e["SHARDSTACK_COMPLETION_TOKENS"]}' in last_usage
    assert e["SHARDSTACK_RESPONSE_BYTES"] == str(len(streamed.content))
    assert e["SHARDSTACK_API_KEY"] == "team-a" and e["MESSAGE"].endswith(" key=team-a")

    e = journal.entry("SHARDSTACK_REQUEST_ID", denied.headers["x-request-id"])
    assert e["SHARDSTACK_STATUS"] == "401" and "SHARDSTACK_PROMPT_TOKENS" not in e
    assert "SHARDSTACK_API_KEY" not in e and " key=" not in e["MESSAGE"]
    e = journal.entry("SHARDSTACK_REQUEST_ID", missing.headers["x-request-id"])
    assert e["SHARDSTACK_STATUS"] == "404" and e["SHARDSTACK_PATH"] == "/no/such/path"  # never the query string
    e = journal.entry("SHARDSTACK_REQUEST_ID", malformed.headers["x-request-id"])
    assert e["SHARDSTACK_STATUS"] == "400" and e["SHARDSTACK_METHOD"] == "POST"

    # A probe that succeeds is no entry; seven requests, six entries, exactly one each. The service writes each
    # entry when its request ends, in order, so waiting for the marker's replaces a fixed sleep.
    journal.entry("SHARDSTACK_REQUEST_ID", marker.headers["x-request-id"])
    ids = [decode_entry(d)["SHARDSTACK_REQUEST_ID"] for d in journal.raw]
    assert sorted(ids) == sorted(r.headers["x-request-id"] for r in (ok, streamed, denied, missing, malformed, marker))
    # Neither the token (right or wrong), nor the Authorization header, nor any prompt text.
    everything = b"".join(journal.raw)
    for secret in (TOKEN, WRONG_TOKEN, "Bearer", "authorization", PROMPT):
        assert secret.encode().lower() not in everything.lower(), secret
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        metrics = c.get("/metrics").text
    assert 'shardstack_infer_requests_total{api_key="team-a",code="200"} 1.0' in metrics
    assert 'shardstack_infer_requests_total{api_key="-",code="401"} 1.0' in metrics
    assert svc.proc.poll() is None


def test_native_protocol_encoding_round_trips() -> None:
    fields = {"MESSAGE": "a line", "MULTI": "two\nlines", "N": 3}
    data = encode_entry(fields)
    assert data.startswith(b"MESSAGE=a line\nMULTI\n\x09\x00\x00\x00\x00\x00\x00\x00two\nlines\nN=3\n")
    assert decode_entry(data) == {"MESSAGE": "a line", "MULTI": "two\nlines", "N": "3"}
    with pytest.raises(ValueError, match="field name"):
        encode_entry({"_PID": 1})  # trusted fields are journald's to set


def test_mode_follows_journald(tmp_path: Path) -> None:
    sock = tmp_path / "journal.sock"
    assert resolve_mode("auto", str(sock), {"JOURNAL_STREAM": "8:123"}) == "off"  # no socket
    assert resolve_mode("journal", str(sock), {}) == "stdout"  # asked for, not there: the line on stdout
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(sock))
        assert resolve_mode("auto", str(sock), {"JOURNAL_STREAM": "8:123"}) == "journal"
        assert resolve_mode("auto", str(sock), {}) == "off"  # stdout not journald's: not run by systemd
        assert resolve_mode("off", str(sock), {"JOURNAL_STREAM": "8:123"}) == "off"


def test_bare_access_log_is_a_line_in_the_log_output(model_dir: Path, workdir: Path) -> None:
    """Not under systemd: `--access-log` alone writes the MESSAGE line to the log output, without the token."""
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    with running_service(model_dir, workdir, "--token-file", str(token_file), "--access-log") as svc:
        r = httpx.post(svc.url + "/v1/completions", headers=JSON, json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200
        line = '"POST /v1/completions" 200 '
        deadline = time.monotonic() + 10
        while line not in svc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        [entry] = [x for x in svc.log().splitlines() if line in x]
        assert "shardstack.serve.access" in entry and f"id={r.headers['x-request-id']}" in entry
        assert "tokens=" in entry and TOKEN not in svc.log() and PROMPT not in svc.log()


def test_one_observation_of_a_response_feeds_both_the_access_log_and_the_metrics(
        caplog: pytest.LogCaptureFixture) -> None:
    """In process: the same status, bytes and time to the last byte reach the access log and the metrics."""
    metrics = ServeMetrics()

    async def streamed(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"ab"
            yield b"cde"
        return StreamingResponse(body())

    async def status(request: Request) -> Response:
        return Response(b"x", status_code=int(request.path_params["code"]))

    async def health(request: Request) -> Response:
        return Response(b"ok")

    app = Starlette(routes=[Route("/v1/completions", streamed, methods=["POST"]), Route("/v1/s/{code}", status),
                            Route("/health", health)],
                    middleware=[Middleware(ObserveResponses, access=AccessLog("stdout"), metrics=metrics)])
    with caplog.at_level(logging.INFO, logger="shardstack.serve.access"), TestClient(app) as client:
        ok = client.post("/v1/completions", headers={"X-Shardstack-Client": "team-a"})
        assert ok.content == b"abcde" and ok.headers["x-request-id"]
        assert client.get("/v1/s/404").status_code == 404
        assert client.get("/v1/s/499").status_code == 499
        assert client.get("/health").status_code == 200
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # not the successful probe
    m = re.search(r'"POST /v1/completions" 200 ([0-9.]+)ms 5B id=(\w+) key=team-a$', lines[0])
    assert m is not None and m[2] == ok.headers["x-request-id"], lines[0]
    sample = metrics.registry.get_sample_value
    assert sample("shardstack_infer_requests_total", {"code": "200", "api_key": "team-a"}) == 1
    assert sample("shardstack_infer_requests_total", {"code": "404", "api_key": "-"}) == 1
    assert sample("shardstack_infer_requests_total", {"code": "499", "api_key": "-"}) is None  # nobody got it
    assert sample("shardstack_infer_requests_total", {"code": "200", "api_key": "-"}) is None  # not /v1/*
    assert sample("shardstack_infer_request_duration_seconds_count") == 1  # successful completions only
    # One observation: the histogram holds exactly the duration the log line shows.
    assert abs(sample("shardstack_infer_request_duration_seconds_sum") * 1000 - float(m[1])) < 0.06
    assert '"GET /v1/s/404" 404' in lines[1] and '"GET /v1/s/499" 499' in lines[2]
