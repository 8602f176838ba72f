"""Job config: defaults, validation errors that name the key, suggestions for typos, no tracebacks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from shardstack.cli import main
from shardstack.errors import ShardstackError
from shardstack.model.gpt import GPTConfig
from shardstack.model.spec import arch_config
from shardstack.train.config import config_from_dict, load_config


def test_defaults_round_trip():
    cfg = config_from_dict({})
    assert cfg.engine.stage == 3 and cfg.engine.precision == "auto" and cfg.checkpoint.dir is None
    assert config_from_dict(cfg.to_dict()) == cfg


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: {size: tiny, d_model: 96, n_head: 3}\noptimizer: {lr: 3e-4}\nengine: {stage: 1}\n")
    cfg = load_config(p)
    assert cfg.optimizer.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string; accepted as a number
    assert arch_config(cfg.model) == GPTConfig(n_layer=2, n_head=3, d_model=96, seq_len=64)


@pytest.mark.parametrize(
    ("data", "key", "hint"),
    [
        ({"engine": {"stgae": 2}}, "engine.stgae", "did you mean 'engine.stage'"),
        ({"optimiser": {}}, "optimiser", "did you mean 'optimizer'"),
        ({"batch": {"micro_bach": 2}}, "batch.micro_bach", "did you mean 'batch.micro_batch'"),
        ({"engine": {"stage": 4}}, "engine.stage", None),
        ({"engine": {"stage": True}}, "engine.stage", None),
        ({"engine": {"precision": "fp8"}}, "engine.precision", None),
        ({"engine": {"offload": "cpu", "stage": 1}}, "engine.offload", "stage 2 or 3"),
        ({"batch": {"micro_batch": "big"}}, "batch.micro_batch", None),
        ({"batch": {"global_batch": 0}}, "batch.global_batch", None),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas", None),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr", None),
        ({"model": {"size": "smal"}}, "model.size", "did you mean 'small'"),
        ({"model": {"factory": "nocolon"}}, "model.factory", None),
        ({"schedule": {"warmup_steps": 10, "total_steps": 5}}, "schedule.warmup_steps", None),
        ({"engine": []}, "engine", None),
    ],
)
def test_bad_configs_name_the_key(data, key, hint):
    with pytest.raises(ShardstackError) as err:
        config_from_dict(data)
    assert f"'{key}'" in str(err.value)
    if hint:
        assert hint in str(err.value)


def test_allowed_values_are_listed():
    with pytest.raises(ShardstackError, match="one of 'auto', 'fp32', 'bf16', 'fp16'"):
        config_from_dict({"engine": {"precision": "fp8"}})


def test_config_hash_ignores_layout_not_math():
    a = config_from_dict({"engine": {"stage": 0}, "batch": {"micro_batch": 2}})
    b = config_from_dict({"engine": {"stage": 3}, "batch": {"micro_batch": 4}})
    c = config_from_dict({"optimizer": {"lr": 1e-3}})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_cli_reports_one_line(tmp_path, capsys):
    p = tmp_path / "job.yaml"
    p.write_text("engine:\n  stgae: 2\n")
    assert main(["estimate", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'engine.stgae'" in err and "did you mean 'engine.stage'" in err


def test_invalid_yaml_and_missing_file(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("engine: [stage\n")
    with pytest.raises(ShardstackError, match="not valid YAML at line"):
        load_config(p)
    with pytest.raises(ShardstackError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_console_script_has_no_traceback(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("batch: {global_batch: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "shardstack", "train", "run", "--config", str(p)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "config key 'batch.global_batch' is -1; expected an integer ≥ 1" in proc.stderr
