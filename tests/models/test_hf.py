"""Hugging Face in and out: a directory written by transformers' save_pretrained → `model.init_from` → 2-rank ZeRO-3
training under torchrun → `export --format hf` → transformers loads it; and bad directories give one clear line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from shardstack.model.artifact import check_model_dir, load_model
from shardstack.signing import load_signing_key
from shardstack.train.data import GlobalSampler, TokenDataset
from shardstack.train.export import export_checkpoint

from .conftest import hf_llama, shardstack, step_lines, torchrun, write_job

SEED, GLOBAL_BATCH, SEQ = 5, 4, 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny GQA Llama with RoPE scaling, saved in three safetensors files plus the index."""
    out = tmp_path_factory.mktemp("hf")
    hf_llama(out, shard_size="200KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) == 3
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf_dir, byte_data, key_file) -> dict:
    root = tmp_path_factory.mktemp("run")
    job = write_job(root / "job.yaml", model={"init_from": str(hf_dir), "seq_len": SEQ},
                    data={"path": str(byte_data)}, engine={"stage": 3},
                    batch={"global_batch": GLOBAL_BATCH, "micro_batch": 1},
                    optimizer={"lr": 1e-3}, schedule={"warmup_steps": 0, "total_steps": 3},
                    checkpoint={"dir": str(root / "ckpt"), "interval": 3, "signing_key_file": str(key_file)},
                    seed=SEED)
    proc = torchrun(2, "-m", "shardstack", "train", "run", "--config", str(job))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "steps": step_lines(proc.stdout), "log": proc.stderr}


def step_one_batch(data: Path) -> torch.Tensor:
    """The global batch of step 1 as every world size sees it (the sampler's stream is world-size independent)."""
    ds = TokenDataset(data, SEQ)
    sampler = GlobalSampler(len(ds), global_batch=GLOBAL_BATCH, world_size=1, rank=0, seed=SEED)
    return torch.from_numpy(np.stack([ds[i] for i in sampler.next_indices()]))


@pytest.mark.distributed
@pytest.mark.slow
def test_init_from_train_export_and_transformers_loads_it(trained, hf_dir, byte_data, key_file, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    steps = trained["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["loss"] < steps[0]["loss"]
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    window = step_one_batch(byte_data)
    with torch.no_grad():
        reference = theirs(input_ids=window, labels=window).loss.item()
    print(f"\nstep 1 loss: ours (2 ranks, ZeRO-3, from the HF directory) {steps[0]['loss']:.6f}, "
          f"transformers {reference:.6f}")
    assert abs(steps[0]["loss"] - reference) <= 1e-4

    ckpt = trained["root"] / "ckpt"
    proc = shardstack("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--format", "hf",
                      "--key-file", str(key_file))
    assert proc.returncode == 0, proc.stderr
    key = load_signing_key(key_file)
    export_checkpoint(ckpt, tmp_path / "hf-sharded", key=key, fmt="hf", max_shard_bytes=150_000)
    export_checkpoint(ckpt, tmp_path / "ours", key=key)
    index = json.loads((tmp_path / "hf-sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (tmp_path / "hf" / "generation_config.json").is_file()

    trained_model, meta = load_model(tmp_path / "ours")  # the checkpoint's weights through our own format
    assert meta["arch"] == "llama" and meta["step"] == 3
    idx = torch.randint(0, 320, (2, SEQ))
    with torch.no_grad():
        ours = trained_model(idx)
        assert (ours - theirs(idx).logits).abs().max() > 1e-3  # training changed the weights
        for d in ("hf", "hf-sharded"):
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path / d).eval()
            diff = (loaded(idx).logits - ours).abs().max().item()
            print(f"transformers on `export --format hf` ({d}) vs the trained checkpoint: max |Δlogits| = {diff:.2e}")
            assert diff <= 1e-4
        # The same directory through our reader (DCP's Hugging Face storage reader), as the server will load it.
        check_model_dir(tmp_path / "hf-sharded")
        via_reader, _ = load_model(tmp_path / "hf-sharded")
        assert (via_reader(idx) - ours).abs().max().item() <= 1e-5


def _damage(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    file = dst / index["weight_map"][k_proj]
    tensors = load_file(file)
    if how == "missing file":
        file.unlink()
    elif how == "missing tensor":
        del tensors[k_proj]
        save_file(tensors, file, metadata={"format": "pt"})
    elif how == "wrong shape":
        tensors[k_proj] = torch.zeros(64, 64)
        save_file(tensors, file, metadata={"format": "pt"})
    elif how == "wrong dtype":
        tensors[k_proj] = tensors[k_proj].half()
        save_file(tensors, file, metadata={"format": "pt"})
    elif how == "index points at a missing file":
        index["weight_map"][k_proj] = "model-00009-of-00009.safetensors"
        index_file.write_text(json.dumps(index))
    elif how == "unsupported architecture":
        config = json.loads((dst / "config.json").read_text())
        config["architectures"] = ["MistralForCausalLM"]
        (dst / "config.json").write_text(json.dumps(config))
    elif how == "no config.json":
        (dst / "config.json").unlink()


@pytest.mark.parametrize(("how", "message"), [
    ("missing file", r"model\.safetensors\.index\.json maps \S+ to model-0000\d-of-00003\.safetensors, which does "
                     r"not exist"),
    ("missing tensor", r"model-0000\d-of-00003\.safetensors does not hold model\.layers\.0\.self_attn\.k_proj\.weight"),
    ("wrong shape", r"model-0000\d-of-00003\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has "
                    r"shape \(64, 64\); config\.json implies \(32, 64\)"),
    ("wrong dtype", r"model-0000\d-of-00003\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight is F16; "
                    r"expected float32 \(config\.json's dtype\)"),
    ("index points at a missing file", r"maps model\.layers\.0\.self_attn\.k_proj\.weight to "
                                       r"model-00009-of-00009\.safetensors, which does not exist"),
    ("unsupported architecture", r"config\.json: unsupported architecture MistralForCausalLM"),
    ("no config.json", r"has no config\.json"),
])
def test_a_bad_directory_is_one_clear_line(hf_dir, byte_data, tmp_path, how, message) -> None:
    import re

    _damage(hf_dir, tmp_path / "bad", how)
    job = write_job(tmp_path / "job.yaml", model={"init_from": str(tmp_path / "bad")},
                    data={"path": str(byte_data)}, batch={"global_batch": 2, "micro_batch": 1})
    proc = shardstack("train", "run", "--config", str(job), "--max-steps", "1")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardstack: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and re.search(message, errors[0]), proc.stderr[-2000:]
