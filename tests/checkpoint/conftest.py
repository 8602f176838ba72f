"""Shared pieces for the checkpoint tests: a tiny model + optimizer app state, a signing key, and a single-process
Checkpointer."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.signing import SigningKey, load_signing_key
from shardstack.train.checkpoint.checkpointer import Checkpointer
from shardstack.train.config import CheckpointConfig
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

TINY = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)
HERE = Path(__file__).parent
REPO = HERE.parent.parent


class AppState(Stateful):
    """The same shape as the trainer's app state: model and optimizer through torch's FQN-keyed state dicts."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = GPT(TINY)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            self.step += 1
            g = torch.Generator().manual_seed(self.step)
            data = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=g)
            loss = self.model(data[:, :-1].contiguous(), data[:, 1:].contiguous())
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        self.step = sd["step"]


def write_key(path: Path, secret: str | None = None, mode: int = 0o400) -> Path:
    """A key file as the training role deploys it: 32 random bytes, hex, readable by its owner only."""
    path.write_text((secret or secrets.token_hex(32)) + "\n")
    path.chmod(mode)
    return path


@pytest.fixture(scope="session")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_key(tmp_path_factory.mktemp("etc") / "checkpoint.key")


@pytest.fixture(scope="session")
def key(key_file: Path) -> SigningKey:
    return load_signing_key(key_file)


def make_checkpointer(root: Path, key_file: Path | None, **overrides) -> Checkpointer:
    """A Checkpointer of job `job` (default test-job) with `config_hash` (default cafe) on `root`, signing with
    `key_file` (None: require_signature false); other overrides are CheckpointConfig fields."""
    cfg = CheckpointConfig(dir=str(root), interval=2, keep=3, signing_key_file=str(key_file or "/nonexistent"),
                           require_signature=key_file is not None, async_save=False)
    job = overrides.pop("job", "test-job")
    config_hash = overrides.pop("config_hash", "cafe")
    return Checkpointer(dataclasses.replace(cfg, **overrides), config_hash=config_hash, job=job, stage=3,
                        job_config={"model": TINY.to_dict()})


def start_group(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start `cmd` in its own session so that `stop_group` can take down torchrun and all of its workers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, env={**env, **kwargs.pop("env", {})}, cwd=REPO, start_new_session=True, **kwargs)


def stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def torchrun(nproc: int, *args: str, timeout: float = 300) -> tuple[int, str]:
    """Run a script under torchrun --standalone (c10d rendezvous on localhost); exit code and combined output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    proc = start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise
    return proc.returncode, out


@pytest.fixture
def app() -> AppState:
    return AppState()
