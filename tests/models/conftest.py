"""Shared pieces for the model tests: the torchrun and CLI runners, a prepared byte-level corpus, tiny Hugging Face
Llama directories written by transformers itself (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N ARGS…` (a script, or `-m shardstack …`)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), *args], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def shardstack(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI in a fresh process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "shardstack", *args], env=ENV, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def step_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def write_job(path: Path, **sections: dict) -> Path:
    """A job.yaml (JSON is YAML) with metrics off unless given."""
    sections.setdefault("metrics", {"port": 0, "peak_tflops": 1.0})
    path.write_text(json.dumps(sections, indent=1))
    return path


@pytest.fixture(scope="session")
def key_file(tmp_path_factory) -> Path:
    """A checkpoint signing key as the training role deploys it (owner-only, off the checkpoint directory)."""
    import secrets

    path = tmp_path_factory.mktemp("etc") / "checkpoint.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o400)
    return path


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory) -> Path:
    from shardstack.train.data import prepare

    out = tmp_path_factory.mktemp("bytes")
    prepare(None, out)
    return out


def hf_llama(out: Path, *, vocab: int = 320, kv_heads: int = 2, tied: bool = False, rope_scaling: bool = True,
             seed: int = 0, dtype: str = "float32", shard_size: str | None = None):
    """A tiny random LlamaForCausalLM saved by transformers' save_pretrained; returns the model (eval, fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16} if rope_scaling else None
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=scaling, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.to(getattr(torch, dtype)).save_pretrained(out, **kwargs)
    return model.float()


def pytest_configure(config: pytest.Config) -> None:
    # torch.distributed.optim scripts its functional optimizers at import; the deprecation is torch's, not ours.
    config.addinivalue_line("filterwarnings", r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
