"""engine.precision, engine.activation_checkpointing and checkpoint.async_save default to `auto`: bf16, every block
recomputed and saves in the background on CUDA (what a GPU cluster's jobs want unless told otherwise); fp32, nothing
recomputed and inline saves on CPU (the lab's, unchanged); an explicit value wins on either device. The settled
values are what the estimate reports and the engine uses."""

from __future__ import annotations

import pytest
from shardstack.model.gpt import GPT
from shardstack.model.shapes import GPTConfig
from shardstack.train.config import EngineConfig, config_from_dict
from shardstack.train.memory.estimate import estimate, estimate_stage


@pytest.mark.parametrize(("device", "precision", "ac"), [("cuda", "bf16", "full"), ("cpu", "fp32", "none")])
def test_auto_settles_per_device(device: str, precision: str, ac: str) -> None:
    settled = EngineConfig().for_device(device)
    assert (settled.precision, settled.activation_checkpointing) == (precision, ac)
    assert settled.for_device("cpu" if device == "cuda" else "cuda") == settled  # settled once, for good


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_explicit_values_win(device: str) -> None:
    cfg = EngineConfig(precision="fp16", activation_checkpointing="every_n", activation_checkpointing_every=2)
    assert cfg.for_device(device) == cfg


def test_the_estimate_reports_and_counts_what_the_device_settles() -> None:
    model = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16, vocab_size=64))
    kw = {"weight_decay": 0.1, "micro_batch": 2, "seq_len": 16}
    gpu = estimate_stage(model, EngineConfig(), 3, 8, 0, device_type="cuda", **kw)
    cpu = estimate_stage(model, EngineConfig(), 3, 8, 0, device_type="cpu", **kw)
    assert (gpu.precision, gpu.activation_checkpointing, gpu.checkpointed_blocks) == ("bf16", "full", 4)
    assert (cpu.precision, cpu.activation_checkpointing, cpu.checkpointed_blocks) == ("fp32", "none", 0)
    assert gpu.activations < cpu.activations  # recomputation keeps only the blocks' inputs


def test_a_job_config_without_engine_settings_is_auto_and_valid() -> None:
    cfg = config_from_dict({"name": "j", "model": {"arch": "gpt", "size": "tiny"}, "engine": {"device": "cpu"}})
    assert (cfg.engine.precision, cfg.engine.activation_checkpointing) == ("auto", "auto")
    (est,) = estimate(cfg, 2, stages=[3])
    assert (est.precision, est.activation_checkpointing) == ("fp32", "none")


@pytest.mark.parametrize(("setting", "device", "background"), [
    ("auto", "cuda", True), ("auto", "cpu", False), (False, "cuda", False), (True, "cpu", True)])
def test_checkpoints_save_in_the_background_on_cuda_unless_told(tmp_path, setting, device: str,
                                                                 background: bool) -> None:
    from shardstack.train.checkpoint.checkpointer import Checkpointer

    cfg = config_from_dict({"name": "j", "model": {"arch": "gpt", "size": "tiny"},
                            "checkpoint": {"dir": str(tmp_path), "async_save": setting, "require_signature": False}})
    settled = cfg.for_device(device)  # the trainer's one place for every device-dependent `auto`
    assert settled.engine == cfg.engine.for_device(device) and settled.checkpoint.async_save is background
    ckpt = Checkpointer(settled.checkpoint, config_hash="0" * 16, job="j")
    assert ckpt.async_save is background and (ckpt._executor is not None) is background
    ckpt.wait()


def test_a_checkpointer_wants_async_save_settled(tmp_path) -> None:
    from shardstack.train.checkpoint.checkpointer import Checkpointer
    from shardstack.train.config import CheckpointConfig

    with pytest.raises(ValueError, match="not settled"):
        Checkpointer(CheckpointConfig(dir=str(tmp_path), require_signature=False), config_hash="0" * 16, job="j")
