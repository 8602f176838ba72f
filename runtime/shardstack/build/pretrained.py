"""The demo's pretrained model, built here with the project's own commands and cached (`shardstack pretrained`,
`make pretrained`; `shardstack demo` builds it when it is missing):

    shardstack tokenizer train --vocab-size 2048        byte-level BPE on the shipped corpus
    shardstack data prepare --tokenizer TOK             the corpus as token shards
    shardstack train run --config job.yaml              a ~1 M-parameter Llama, one CPU process, seeded
    shardstack export --format hf                       transformers' layout + the tokenizer: what `model.init_from`
                                                        and `shardstack serve --model` both take

into $SHARDSTACK_CACHE/pretrained/stdlib-llama-<key>, the key a hash of this recipe and the corpus, so a changed
recipe builds a new model and an unchanged one is reused. pretrained.json beside the weights records the loss curve,
the time and every file's size and sha256. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from shardstack.errors import ShardstackError
from shardstack.model.tokenizer import CHAT_TEMPLATE

NAME = "stdlib-llama"
RECORD = "pretrained.json"
VOCAB = 2048
STEPS = 300
CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "stdlib-docstrings.txt"
# Small enough to train in minutes on 2 CPU cores: ≈ 1.0 M parameters, 300 steps × 8 × 128 tokens ≈ 1.4 passes over
# the corpus (~222 k tokens with this tokenizer); grouped-query attention (2 key/value heads for 4) as in Llama 3.
JOB: dict[str, Any] = {
    "model": {"arch": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 128, "ffn_dim": 352,
              "seq_len": 128, "vocab_size": VOCAB, "tie_embeddings": True},
    "engine": {"stage": 0, "device": "cpu", "precision": "fp32"},
    "optimizer": {"lr": 3.0e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "schedule": {"warmup_steps": 30, "total_steps": STEPS, "min_lr_ratio": 0.1},
    "batch": {"global_batch": 8, "micro_batch": 8},
    "metrics": {"port": 0, "log_every": 10},
    "seed": 1337,
}


def cache_root() -> Path:
    return Path(os.environ.get("SHARDSTACK_CACHE", "/var/cache/shardstack")) / "pretrained"


def recipe_key() -> str:
    h = hashlib.sha256(json.dumps({"job": JOB, "vocab": VOCAB, "chat": CHAT_TEMPLATE}, sort_keys=True).encode())
    h.update(CORPUS.read_bytes())
    return h.hexdigest()[:12]


def model_dir() -> Path:
    """Where the model of the current recipe is (or will be) cached."""
    return cache_root() / f"{NAME}-{recipe_key()}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(*, force: bool = False, echo: Callable[[str], None] = print) -> Path:
    """The cached model directory, trained first if it is not there (or `force`). Returns its path."""
    out = model_dir()
    if (out / RECORD).is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.work-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    tok, data, ckpt, export, log = (work / n for n in ("tokenizer", "data", "checkpoints", "export", "steps.jsonl"))
    job = {**JOB, "data": {"path": str(data)},
           # A local single-user run: its checkpoints are unsigned, and exported with --allow-unsigned.
           "checkpoint": {"dir": str(ckpt), "interval": STEPS, "keep": 1, "require_signature": False},
           "metrics": {**JOB["metrics"], "json_log": str(log)}}
    (work / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    # One torch thread: the same float reductions on every machine (the weights are reproducible), and no spinning
    # OpenMP threads, which make a small model many times slower on a machine shared with other work.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    try:
        for args in (["tokenizer", "train", str(CORPUS), "--vocab-size", str(VOCAB), "--out", str(tok)],
                     ["data", "prepare", "--tokenizer", str(tok), "--out", str(data)],
                     ["train", "run", "--config", str(work / "job.yaml")],
                     ["export", "--checkpoint", str(ckpt), "--out", str(export), "--format", "hf",
                      "--allow-unsigned"]):
            echo("$ shardstack " + " ".join(args))
            res = subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True,
                                 env=env)
            if res.returncode != 0:
                raise ShardstackError(f"`shardstack {' '.join(args[:2])}` failed building the pretrained model:\n"
                                      f"{(res.stderr or res.stdout).strip()[-2000:]}",
                                      hint=f"its files are in {work}; rerun `shardstack pretrained --force`")
        steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        record = {
            "recipe": "shardstack pretrained (shardstack/build/pretrained.py)",
            "key": recipe_key(),
            "job": JOB,
            "train_tokens": json.loads((data / "meta.json").read_text())["total_tokens"],
            "loss_curve": [[s["step"], round(s["loss"], 4)] for s in steps if "loss" in s],
            "seconds": round(time.monotonic() - started),
            "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(export.iterdir())},
        }
        (export / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        export.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def record(path: Path) -> dict[str, Any]:
    """The build record of a cached model directory."""
    try:
        return json.loads((path / RECORD).read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path} holds no readable {RECORD} ({exc})",
                              hint="build it: shardstack pretrained") from None
