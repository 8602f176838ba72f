"""The demo's pretrained model recipe (shardstack.build.pretrained): a valid job, a cache key that follows the recipe,
and the whole chain — tokenizer train → data prepare → train run → export --format hf — run for real at a tiny size,
giving a directory the server and `init_from` take, cached on the second call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shardstack.build import pretrained
from shardstack.model.artifact import load_model
from shardstack.model.tokenizer import HFTokenizer
from shardstack.train.config import config_from_dict


def test_the_recipe_is_a_valid_job_keyed_by_its_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = config_from_dict({**pretrained.JOB, "data": {"path": "/x"}})
    assert cfg.model.arch == "llama" and cfg.model.overrides.vocab_size == pretrained.VOCAB
    monkeypatch.setenv("SHARDSTACK_CACHE", str(tmp_path))
    key = pretrained.recipe_key()
    assert pretrained.model_dir() == tmp_path / "pretrained" / f"stdlib-llama-{key}"
    monkeypatch.setattr(pretrained, "JOB", {**pretrained.JOB, "seed": 1})
    assert pretrained.recipe_key() != key


@pytest.mark.timeout(900)
def test_a_tiny_build_serves_and_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDSTACK_CACHE", str(tmp_path))
    tiny = {**pretrained.JOB, "model": {**pretrained.JOB["model"], "n_layer": 1, "d_model": 32, "n_head": 2,
                                        "n_kv_head": 1, "ffn_dim": 64, "seq_len": 32, "vocab_size": 300},
            "schedule": {"warmup_steps": 1, "total_steps": 3}, "metrics": {"port": 0, "log_every": 1}}
    monkeypatch.setattr(pretrained, "JOB", tiny)
    monkeypatch.setattr(pretrained, "VOCAB", 300)
    monkeypatch.setattr(pretrained, "STEPS", 3)
    lines: list[str] = []
    out = pretrained.build(echo=lines.append)
    assert out == pretrained.model_dir() and [line.split()[2:4] for line in lines] == [
        ["tokenizer", "train"], ["data", "prepare"], ["train", "run"], ["export", "--checkpoint"]]
    rec = pretrained.record(out)
    assert [s for s, _ in rec["loss_curve"]] == [1, 2, 3] and rec["train_tokens"] > 100_000
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(rec["files"])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = load_model(out)[0]
    assert model.config.vocab_size == 300 and HFTokenizer(out).vocab_size == 300
    assert not list(out.parent.glob(".*work*"))  # the work directory is gone
    lines.clear()
    assert pretrained.build(echo=lines.append) == out and lines == []  # cached: nothing runs again
