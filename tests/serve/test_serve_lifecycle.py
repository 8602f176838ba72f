"""Process-level behaviour of `shardstack serve`: overload back-pressure, drain on SIGTERM, a hung engine seen
by /health and the systemd watchdog, HTTPS, and start-up failures."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from shardstack.cli import main
from shardstack.serve.apierror import ErrorBody

from .conftest import Service, TlsFiles, assert_https_only, running_service


def _complete(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def small_svc(model_dir: Path) -> Iterator[Service]:
    """2 slots + 2 queue places. Shared by the overload test and, last in this file, the drain test."""
    with tempfile.TemporaryDirectory(prefix="ss-") as tmp, running_service(
        model_dir, Path(tmp), "--max-concurrency", "2", "--max-queue", "2", "--drain-seconds", "60"
    ) as svc:
        yield svc


def test_overload_gets_429_with_retry_after_and_no_5xx(small_svc: Service) -> None:
    # 2 running + 2 queued fit; 12 at once must overflow, and every admitted request must still finish.
    svc = small_svc
    body = {"prompt": "overload", "max_tokens": 96, "temperature": 1.0}
    barrier = threading.Barrier(12)
    # One pooled client made beforehand: building a client per request (TLS context and all) on a busy machine
    # would spread the burst over longer than a request lasts.
    with httpx.Client(base_url=svc.url, timeout=120, limits=httpx.Limits(max_connections=12)) as client:

        def fire(_: int) -> httpx.Response:
            barrier.wait()
            return client.post("/v1/completions", json=body)

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(fire, range(12)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 4, codes  # at least the 2 running + 2 queued got through
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            err = ErrorBody.model_validate_json(r.content).error
            assert (err.type, err.code) == ("rate_limit_error", "rate_limit_exceeded")
        else:
            assert r.json()["usage"]["completion_tokens"] == 96
            assert r.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(svc.url + "/metrics").text
    assert f'shardstack_infer_requests_total{{api_key="-",code="429"}} {codes.count(429)}.0' in metrics
    assert 'code="5' not in metrics
    assert httpx.get(svc.url + "/health").json()["status"] == "ok"

    # A client that goes away mid-stream frees its slot instead of decoding to max_tokens.
    before = _generated(svc.url)
    body = {"prompt": "bye", "max_tokens": 250, "stream": True}
    with httpx.stream("POST", svc.url + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line)
    deadline = time.monotonic() + 20
    while httpx.get(svc.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(svc.url + "/health").json()["running"] == 0
    assert _generated(svc.url) - before < 250


def _generated(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("shardstack_infer_generation_tokens_total "))
    return float(line.split()[1])


STALL = 1.0  # s: --stall-seconds of the hung-engine test
CEILING = 120.0  # s: the most a test waits for a state it expects, on a loaded 2-core host


def _heartbeat(url: str) -> float:
    """The engine loop's last heartbeat (Unix time) from /metrics: frozen from the moment the loop hangs."""
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("shardstack_infer_engine_heartbeat_timestamp_seconds "))
    return float(line.split()[1])


def _until(what: str, ready: Callable[[], bool], timeout: float = CEILING) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def _fresh(svc: Service, key: str) -> None:
    """Wait for a `key` notification sent after now (what is already queued is drained first)."""
    svc.notify.poll(0.01)
    since = time.monotonic()

    def arrived() -> bool:
        svc.notify.poll(0.05)
        return svc.notify.count(key, since=since) > 0

    _until(f"a fresh {key} on NOTIFY_SOCKET", arrived)


def test_hung_engine_fails_health_and_starves_the_watchdog(model_dir: Path, workdir: Path) -> None:
    """/health stays 200 while idle and until the loop has been hung for the stall bound, then 503 "stalled"; no
    WATCHDOG=1 from then on. Timed against the engine's own heartbeat (frozen at the hang), not a wall-clock window,
    so a loaded host can delay the flip's observation but not make a correct service fail."""
    env = {"SHARDSTACK_SERVE_FAILPOINT": "engine_hang", "WATCHDOG_USEC": "400000"}
    with running_service(model_dir, workdir, "--stall-seconds", str(STALL), "--drain-seconds", "1", env=env) as svc:
        # Idle for longer than the stall bound is not hung: the idle loop beats every 0.25 s.
        time.sleep(max(0.0, svc.notify.wait_for("READY") + 1.5 * STALL - time.monotonic()))
        assert httpx.get(svc.url + "/health").status_code == 200
        _fresh(svc, "WATCHDOG")  # fed while the loop idles

        lines: list[str] = []

        def doomed() -> None:  # streamed: its headers go out before the engine hangs; the drain at teardown aborts it
            body = {"prompt": "hang the engine", "max_tokens": 8, "stream": True}
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", svc.url + "/v1/completions", json=body,
                                                                    timeout=CEILING) as r:
                lines.extend(line for line in r.iter_lines() if line)

        # The loop beats after taking this request and then hangs: its last heartbeat is after t0.
        t0, t0_wall = time.monotonic(), time.time()
        doomed_thread = threading.Thread(target=doomed, daemon=True)
        doomed_thread.start()
        ok_asked: list[float] = []  # wall time each /health that answered 200 was sent
        while True:
            asked = time.time()
            r = httpx.get(svc.url + "/health", timeout=CEILING)
            if r.status_code != 200:
                break
            ok_asked.append(asked)
            assert time.monotonic() - t0 < CEILING, "/health still 200 with the engine hung"
            time.sleep(0.05)
        flipped = time.monotonic()
        svc.notify.poll(0.01)  # every ping sent before that 503 was decided is queued by now: drain them
        quiet_since = time.monotonic()
        assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
        # Never early: the heartbeat froze after t0, so a correct 503 cannot arrive before t0 + the bound.
        assert flipped - t0 > STALL and r.json()["heartbeat_age_seconds"] > STALL, (flipped - t0, r.text)
        # Never late: no 200 to a probe sent once the loop had been hung (last heartbeat) for the bound.
        hung_at = _heartbeat(svc.url)
        assert hung_at >= t0_wall and "failpoint engine_hang: engine loop blocks now" in svc.log()
        assert _heartbeat(svc.url) == hung_at  # frozen: the loop is hung, not slow
        late = [asked - hung_at for asked in ok_asked if asked > hung_at + STALL]
        assert not late, f"/health said 200 {late} s after the loop hung (bound {STALL} s)"
        new = _complete(svc.url, {"prompt": "anyone?", "max_tokens": 2})
        assert new.status_code == 503 and "no progress" in ErrorBody.model_validate_json(new.content).error.message
        # No WATCHDOG=1 once stalled: systemd would now kill and restart the unit. The feeder logs when it sees the
        # stall; after that, several of its 0.2 s intervals more without a ping.
        _until("the watchdog feeder saw the stall", lambda: "engine loop stalled" in svc.log())
        svc.notify.poll(1.2)
        assert svc.notify.count("WATCHDOG", since=quiet_since) == 0
    # The stream already had its 200: the abort reached it in-band, in the same error shape, then [DONE].
    doomed_thread.join(CEILING)
    assert not doomed_thread.is_alive()
    assert lines[-1] == "data: [DONE]", lines
    err = ErrorBody.model_validate_json(lines[-2].removeprefix("data: ")).error
    assert (err.type, err.code) == ("server_error", "unavailable") and "aborted" in err.message


def test_model_that_fails_to_load_exits_nonzero_without_ready(model_dir: Path, workdir: Path) -> None:
    broken = workdir / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model"]["n_layer"] = 5  # weights for 4 layers
    (broken / "config.json").write_text(json.dumps(cfg))
    svc = Service(broken, workdir)
    assert svc.proc.wait(90) == 1, svc.log()
    svc.notify.poll(0.1)
    assert svc.notify.count("READY") == 0
    assert "does not match" in svc.log()
    svc.stop()


def test_cli_rejects_bad_arguments_in_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shardstack", "serve", "--allow-unsigned", *args],
                              capture_output=True, text=True, timeout=60)

    missing = run("--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    incomplete = run("--model", str(tmp_path / "m"))
    assert incomplete.returncode == 2 and "no model.safetensors" in incomplete.stderr
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "token").write_text("\n")
    no_token = run("--model", str(tmp_path / "m"), "--token-file", str(tmp_path / "token"))
    assert no_token.returncode == 2 and "non-empty token" in no_token.stderr
    bad_flag = run("--model", str(tmp_path / "m"), "--max-concurrency", "0")
    assert bad_flag.returncode == 2 and "must be > 0" in bad_flag.stderr


def test_https_with_the_cluster_ca_only_tls_1_2_or_newer_and_no_plain_http(model_dir: Path, workdir: Path,
                                                                         tls_files: TlsFiles) -> None:
    """What the load balancer gets from a backend started with the certificate the role issues from the cluster CA."""
    with running_service(model_dir, workdir, *tls_files.args, ca=tls_files.ca) as svc:
        assert svc.url.startswith("https://")  # wait_ready polled /health over it, verifying against the CA
        with httpx.Client(base_url=svc.url, verify=svc.verify, timeout=120) as client:
            assert client.get("/health").json()["status"] == "ok"
            r = client.post("/v1/completions", json={"prompt": "over TLS", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # not a public CA's certificate
            httpx.get(svc.url + "/health", timeout=30)
        assert_https_only(svc.port, tls_files.ca)
        assert svc.proc.poll() is None, svc.log()


def test_tls_needs_a_readable_certificate_with_its_key_said_in_one_line(model_dir: Path, tls_files: TlsFiles,
                                                                         tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def serve(*args: str) -> tuple[int, str]:
        code = main(["serve", "--model", str(model_dir), "--allow-unsigned", *args])
        err = capsys.readouterr().err
        assert err.startswith("shardstack: error: ") and err.count("\n") == 1, err  # one line, no traceback
        return code, err

    cert, key = str(tls_files.cert), str(tls_files.key)
    for alone in (["--tls-cert", cert], ["--tls-key", key]):
        assert serve(*alone) == (2, "shardstack: error: --tls-cert and --tls-key go together: both (HTTPS) or "
                                    "neither (plain HTTP)\n")
    code, err = serve("--tls-cert", cert, "--tls-key", str(tmp_path / "nokey"))
    assert code == 2 and f"cannot read --tls-key {tmp_path / 'nokey'}: No such file or directory" in err
    code, err = serve("--tls-cert", str(tls_files.ca), "--tls-key", key)  # the CA's certificate: not this key's
    assert code == 2 and "the key does not belong to the certificate" in err
    code, err = serve("--tls-cert", key, "--tls-key", cert)
    assert code == 2 and "not a PEM certificate and an unencrypted PEM private key" in err


def test_a_drain_lasts_until_no_request_was_turned_away_for_the_quiet_time(model_dir: Path, tmp_path: Path) -> None:
    """Nothing in flight, but requests still arriving (a load balancer that has not yet seen /health fail): the server
    turns each away with a 503 the balancer retries, and stops only once none came for --drain-quiet-seconds, so it
    never resets a request already sent to it (the balancer cannot retry that one: the client would get a 502)."""
    quiet = 2.0
    with running_service(model_dir, tmp_path, "--drain-quiet-seconds", str(quiet)) as svc:
        svc.proc.send_signal(signal.SIGTERM)
        svc.notify.wait_for("STOPPING", timeout=CEILING)
        codes, last_sent = [], 0.0
        until = time.monotonic() + 2 * quiet
        with httpx.Client(base_url=svc.url, timeout=CEILING) as client:
            while time.monotonic() < until:
                last_sent = time.monotonic()
                codes.append(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code)
                time.sleep(quiet / 8)
        assert set(codes) == {503} and len(codes) > 4, codes
        assert svc.proc.wait(CEILING) == 0, svc.log()
        assert time.monotonic() - last_sent >= quiet


def test_sigterm_drains_in_flight_refuses_new_and_exits_zero(small_svc: Service) -> None:
    # Runs last in this module: it ends the shared service. 3 requests on 2 slots: 2 decoding, 1 queued.
    svc = small_svc
    results: list[tuple[int, str, int]] = []
    # The three must arrive together: one arriving after the first has finished (a thread started late on a busy
    # machine) would find a free slot, and 2 running + 1 waiting would never be seen. So: one pooled client, and
    # the three sent past one barrier.
    client = httpx.Client(base_url=svc.url, timeout=120, limits=httpx.Limits(max_connections=3))
    barrier = threading.Barrier(3)

    def streaming_request(i: int) -> None:
        body = {"prompt": f"in flight {i}", "max_tokens": 200, "stream": True, "seed": i,
                "stream_options": {"include_usage": True}}
        barrier.wait()
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        results.append((r.status_code, lines[-1], usage["completion_tokens"]))

    threads = [threading.Thread(target=streaming_request, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (state := httpx.get(svc.url + "/health").json()) != {"status": "ok", "running": 2, "waiting": 1}:
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    svc.proc.send_signal(signal.SIGTERM)
    svc.notify.wait_for("STOPPING", timeout=CEILING)
    # Still listening, but not admitting: the balancer sees 503 on /health and new requests get 503.
    health = httpx.get(svc.url + "/health")
    refused = _complete(svc.url, {"prompt": "too late", "max_tokens": 4})
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    assert refused.status_code == 503
    assert ErrorBody.model_validate_json(refused.content).error.code == "unavailable"
    assert refused.headers["retry-after"] == "1"
    for t in threads:
        t.join(120)
    client.close()
    assert results == [(200, "data: [DONE]", 200)] * 3  # the queued one too
    assert svc.proc.wait(60) == 0, svc.log()
    assert "Traceback" not in svc.log()
