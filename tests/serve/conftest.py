"""Fixtures that run the real service: `python -m shardstack serve` in a subprocess on a free loopback port,
with $NOTIFY_SOCKET pointing at a unix datagram socket the test owns (what systemd would provide).

`svc`/`client` is one token-protected service shared by the API tests and the fuzz test (one start-up, not two,
on a 2-core machine)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from shardstack.model.tokenizer import HFTokenizer
from shardstack.serve.demo import write_random_model

READY_TIMEOUT = 180.0  # import torch + load + warm-up on a busy 2-core machine (importing torch alone: 37 s at load 9)


class NotifySocket:
    """The receiving end of sd_notify: collects every datagram the service sends."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def poll(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        with contextlib.suppress(TimeoutError):
            while True:
                data = self.sock.recv(4096)
                fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
                self.messages.append((time.monotonic(), fields))
                self.sock.settimeout(0.001)

    def wait_for(self, key: str, value: str = "1", timeout: float = 10.0) -> float:
        """Time the first message with key=value arrived (waiting for it if needed)."""
        deadline = time.monotonic() + timeout
        while True:
            for at, fields in self.messages:
                if fields.get(key) == value:
                    return at
            if time.monotonic() > deadline:
                raise AssertionError(f"no {key}={value} on NOTIFY_SOCKET within {timeout}s: {self.messages}")
            self.poll(0.05)

    def count(self, key: str, since: float = 0.0) -> int:
        return sum(1 for at, f in self.messages if key in f and at >= since)

    def close(self) -> None:
        self.sock.close()


class Service:
    """One `shardstack serve` process. With `ca` (it is started with --tls-cert/--tls-key): its URL is https and
    `verify` trusts that CA only, for the clients tests build."""

    def __init__(self, model: Path, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 python: str = sys.executable, ca: Path | None = None, ready_timeout: float = READY_TIMEOUT) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.ready_timeout = ready_timeout
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else True
        self.notify = NotifySocket(workdir)
        self.log_path = workdir / "serve.log"
        self._log = self.log_path.open("w")
        self.health_seen: list[tuple[int, str]] = []
        # The random models of these tests are unsigned; a test of verification passes --key-file.
        trust = [] if "--key-file" in args else ["--allow-unsigned"]
        cmd = [python, "-m", "shardstack", "serve", "--model", str(model), "--port", str(self.port),
               "--threads", "1", *trust, *args]
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self) -> None:
        """Poll /health until READY=1 arrives, remembering what /health said meanwhile."""
        deadline = time.monotonic() + self.ready_timeout
        while not any(f.get("READY") == "1" for _, f in self.notify.messages):
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no READY=1 within {self.ready_timeout}s:\n{self.log()}")
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(self.url + "/health", timeout=2, verify=self.verify)
                json_body = r.headers.get("content-type", "").startswith("application/json")
                self.health_seen.append((r.status_code, r.json()["status"] if json_body else r.text))
            self.notify.poll(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.notify.close()
        return self.proc.returncode


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the cluster CA's certificate: what clients verify against
    cert: Path
    key: Path

    @property
    def args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """The cluster CA and a server certificate for localhost and 127.0.0.1, issued by the roles' own module
    (roles/shardstack_common/library/cluster_certificate.py) as tests/ops' `issue` does."""
    path = Path(__file__).resolve().parents[2] / "roles" / "shardstack_common" / "library" / "cluster_certificate.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    cc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cc  # dataclasses look their module up while the class is built
    spec.loader.exec_module(cc)
    store = tmp_path_factory.mktemp("tls")
    files = TlsFiles(ca=store / "ca.crt", cert=store / "server.crt", key=store / "server.key")
    names = ["localhost", "127.0.0.1"]
    plan = cc.plan(files.ca, store / "ca.key", files.cert, files.key, names, renew_days=30)
    cc.apply(plan, files.ca, store / "ca.key", files.cert, files.key, names, ca_common_name="test cluster CA",
             valid_days=90)
    return files


def tls_handshake(port: int, ca: Path, oldest: ssl.TLSVersion, newest: ssl.TLSVersion) -> str:
    """The TLS version a client limited to oldest..newest negotiates with 127.0.0.1:port; ssl.SSLError if refused.
    Security level 0: this client offers TLS 1.0/1.1 for real (at OpenSSL's default level it would not even try),
    so a refusal is the server's."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated: offering them is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version, ctx.maximum_version = oldest, newest
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return str(tls.version())


def assert_https_only(port: int, ca: Path) -> None:
    """The service on 127.0.0.1:port speaks TLS 1.2 or newer and nothing else: plain HTTP gets no response (the
    handshake fails and the connection closes), a TLS 1.1-at-most client is refused by the server (a failure of the
    client's own, no ciphers or protocols to offer, would have another reason)."""
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
    v = ssl.TLSVersion
    assert tls_handshake(port, ca, v.TLSv1_2, v.TLSv1_2) == "TLSv1.2"
    with pytest.raises(ssl.SSLError) as refused:
        tls_handshake(port, ca, v.TLSv1, v.TLSv1_1)
    assert refused.value.reason in ("UNEXPECTED_EOF_WHILE_READING", "TLSV1_ALERT_PROTOCOL_VERSION"), refused.value


@pytest.fixture(scope="session")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ss-serve-model-") as tmp:
        # The demo size (preset "small": 4 layers, d=128, context 256), seeded random weights, export layout.
        yield write_random_model(Path(tmp) / "small", "small", seed=1234)


# The Llama test model's second EOS (Llama 3 style: generation_config.json lists several): the token it greedily
# generates as the EOS_AT-th after EOS_PROMPT.
EOS_PROMPT, EOS_AT = "The value of", 6


def greedy_ids(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """The first n ids the model in `model_dir` generates greedily (plain forward passes, no KV cache)."""
    import torch
    from shardstack.model.artifact import load_model

    model = load_model(model_dir)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="session")
def bpe_tokenizer_dir() -> Iterator[Path]:
    """A byte-level BPE tokenizer of 4096 tokens trained here on the shipped corpus, as `tokenizer train` makes it."""
    from shardstack.model.tokenizer import train_bpe

    corpus = Path(__file__).resolve().parents[2] / "runtime" / "shardstack" / "corpus" / "stdlib-docstrings.txt"
    with tempfile.TemporaryDirectory(prefix="ss-bpe-") as tmp:
        train_bpe([corpus], 4096, tmp)
        yield Path(tmp)


@pytest.fixture(scope="session")
def signing_key_file() -> Iterator[Path]:
    """The cluster's signing key as the inference role hands it to the service (owner-only)."""
    import secrets

    with tempfile.TemporaryDirectory(prefix="ss-key-") as tmp:
        path = Path(tmp) / "signing-key"
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o400)
        yield path


@pytest.fixture(scope="session")
def bpe_model_dir(bpe_tokenizer_dir: Path, signing_key_file: Path) -> Iterator[Path]:
    """A random Llama (preset small: 4 layers, d=128, 4 query / 2 key-value heads, context 256) with that
    byte-level BPE tokenizer (4096 tokens), in Hugging Face's layout as `export --format hf` writes it, with the
    manifest export signs with `signing_key_file`. Its generation_config.json adds a second EOS id: the token it
    greedily generates EOS_AT-th after EOS_PROMPT."""
    from shardstack.model.manifest import write_manifest
    from shardstack.model.tokenizer import HFTokenizer
    from shardstack.signing import load_signing_key

    with tempfile.TemporaryDirectory(prefix="ss-serve-llama-") as tmp:
        out = write_random_model(Path(tmp) / "llama", "small", arch="llama", tokenizer=bpe_tokenizer_dir, fmt="hf",
                                 seed=1234)
        ids = greedy_ids(out, HFTokenizer(out).encode_prompt(EOS_PROMPT), EOS_AT)
        assert ids[-1] not in ids[:-1], ids  # otherwise generation would end earlier than the test expects
        config = json.loads((out / "generation_config.json").read_text())
        (out / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [0, ids[-1]]}))
        write_manifest(out, load_signing_key(signing_key_file), step=0, source="random")
        yield out


class CountingTokenizer(HFTokenizer):
    """A real tokenizer that counts the prompts it encodes."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.calls = 0

    def encode_prompt(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode_prompt(text)


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short path under /tmp: unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="ss-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def running_service(model: Path, workdir: Path, *args: str, env: dict[str, str] | None = None,
                    ca: Path | None = None) -> Iterator[Service]:
    svc = Service(model, workdir, *args, env=env, ca=ca)
    try:
        svc.wait_ready()
        yield svc
    finally:
        if svc.proc.poll() is None:
            svc.stop()


TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@contextlib.contextmanager
def _authenticated_service(model: Path, *args: str) -> Iterator[Service]:
    """The service the API tests share: bearer token, bounded tokens, body and concurrency."""
    with tempfile.TemporaryDirectory(prefix="ss-") as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN + "\n")
        with running_service(model, Path(tmp), "--token-file", str(token_file), "--max-tokens", "64",
                             "--max-body-bytes", "65536", "--max-concurrency", "8", *args) as s:
            yield s


@pytest.fixture(scope="session")
def svc(model_dir: Path) -> Iterator[Service]:
    with _authenticated_service(model_dir) as s:
        yield s


@pytest.fixture(scope="session")
def client(svc: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def bpe_svc(bpe_model_dir: Path, signing_key_file: Path) -> Iterator[Service]:
    """The same service over the BPE Llama (also named "small", so the fuzz test's requests fit either), which it
    verifies against the signed manifest as the deployed service does."""
    with _authenticated_service(bpe_model_dir, "--model-name", "small", "--key-file", str(signing_key_file)) as s:
        yield s


@pytest.fixture(scope="session")
def bpe_client(bpe_svc: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=bpe_svc.url, timeout=60) as c:
        yield c
