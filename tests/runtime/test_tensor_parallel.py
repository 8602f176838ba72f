"""engine.tensor_parallel: the real trainer under torchrun (CPU, gloo, fp32) on a 2-D ("dp", "tp") mesh gives the
losses of one process, its checkpoints resume at another TP degree and data-parallel size, bad combinations are
one clear config error, and the estimator divides the split projections by K.

One reference run in this process (world 1), one 2 (dp) × 2 (tp) run with a checkpoint at step 3, and two
2-process resumes of that checkpoint: at TP 1 (dp 2), and at TP 2 (dp 1) with stage 2 and activation checkpointing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import torch
import yaml
from shardstack.errors import ShardstackError
from shardstack.model.spec import ModelConfig, build_model
from shardstack.train import dist
from shardstack.train.config import config_from_dict, load_config
from shardstack.train.data import prepare
from shardstack.train.memory.estimate import FP32, estimate
from shardstack.train.trainer import train

# GQA: 4 query heads share 2 key/value heads, so TP 2 gives each rank 2 query heads and their one key/value head.
LLAMA = {"arch": "llama", "size": "tiny", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_dim": 64,
         "seq_len": 32}
STEPS, INTERVAL = 5, 3
RTOL = 1e-5  # the engine tests' parity bound; the lines carry 6 decimals of the loss, 5 of the norm (≤ 1e-5 here)
CLIP = 0.2  # below every step's gradient norm: the 2-D mesh's global norm scales every update


def job_dict(tmp: Path, data: Path, ckpt: Path | None = None, *, tp: int = 1, **engine) -> dict:
    return {
        "model": LLAMA,
        "data": {"path": str(data)},
        "engine": {"stage": 3, "device": "cpu", "tensor_parallel": tp, **engine},
        "optimizer": {"lr": 3e-3, "grad_clip": CLIP},
        "schedule": {"warmup_steps": 2, "total_steps": STEPS},
        "batch": {"global_batch": 4, "micro_batch": 2},
        "checkpoint": {"dir": str(ckpt) if ckpt else None, "interval": INTERVAL, "require_signature": False},
        "metrics": {"port": 0},
        "seed": 7,
    }


def write_job(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(nproc: int, config: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "shardstack", "train", "run", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def steps(output: str) -> dict[int, tuple[float, float]]:
    """step → (loss, gradient norm before clipping) from the JSON lines rank 0 prints."""
    recs = (json.loads(x) for x in output.splitlines() if x.startswith('{"step"'))
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}


def assert_matches(got: dict[int, tuple[float, float]], ref: dict[int, tuple[float, float]], span: range) -> None:
    assert sorted(got) == list(span), got
    for s in span:
        assert got[s] == pytest.approx(ref[s], rel=RTOL), (s, got, ref)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare(None, out)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[int, tuple[float, float]]:
    """One process, no tensor parallelism."""
    torch.set_num_threads(1)
    cfg = load_config(write_job(tmp_path_factory.mktemp("ref") / "job.yaml", job_dict(Path(), data_dir)))
    out = StringIO()
    dist.init_distributed("cpu")
    try:
        train(cfg, out=out)
    finally:
        dist.shutdown()
    ref = steps(out.getvalue())
    assert ref[STEPS][0] < ref[1][0] and all(norm > CLIP for _, norm in ref.values()), ref
    return ref


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("tp2")
    out = torchrun(4, write_job(tmp / "job.yaml", job_dict(tmp, data_dir, tmp / "ckpt", tp=2)))
    return tmp / "ckpt", out


@pytest.mark.distributed
def test_2x2_mesh_gives_the_losses_of_one_process(reference, mesh_2x2):
    _ckpt, out = mesh_2x2
    assert "tensor parallel: a 2 (dp) × 2 (tp) mesh" in out
    assert_matches(steps(out), reference, range(1, STEPS + 1))
    # The estimator's per-rank params + grads + optimizer are the local shards the engine measured, exactly.
    ratio = re.search(r"estimated [\d.]+ MiB, measured [\d.]+ MiB \(ratio ([\d.]+)\)", out)
    assert ratio and float(ratio.group(1)) == 1.0, out[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize(("nproc", "tp", "engine"), [
    (2, 1, {}),  # TP 2 → TP 1, dp 2
    (2, 2, {"stage": 2, "activation_checkpointing": "full"}),  # dp 2 → dp 1 at TP 2, ZeRO-2, recomputed blocks
], ids=["tp1-dp2", "tp2-dp1-stage2-ac"])
def test_tp2_checkpoint_resumes_at_another_layout(reference, mesh_2x2, data_dir, tmp_path, nproc, tp, engine):
    src, _ = mesh_2x2
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src / "step_00000003", ckpt / "step_00000003")  # the newest but one: resume at step 3
    out = torchrun(nproc, write_job(tmp_path / "job.yaml", job_dict(tmp_path, data_dir, ckpt, tp=tp, **engine)))
    assert re.search(r"\(step 3, saved by 4 ranks at stage 3; now 2 ranks\)", out), out[-3000:]
    assert_matches(steps(out), reference, range(INTERVAL + 1, STEPS + 1))


# --- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "engine", "message"), [
    ({"n_kv_head": 2}, {"tensor_parallel": 4}, r"'engine.tensor_parallel' is 4, but model.n_kv_head \(2\) is not "
                                                r"divisible by it"),
    ({"n_head": 6, "n_kv_head": 6, "d_model": 48}, {"tensor_parallel": 4},
     r"'engine.tensor_parallel' is 4, but model.n_head \(6\) is not divisible by it"),
    ({}, {"tensor_parallel": 2, "stage": 1}, r"'engine.tensor_parallel' is 2 but engine.stage is 1"),
    ({}, {"tensor_parallel": 2, "compile": True}, r"does not combine with engine.compile"),
    ({"arch": "gpt", "n_kv_head": None, "ffn_dim": None}, {"tensor_parallel": 2}, r"but the model is arch gpt"),
    ({}, {"tensor_parallel": 0}, r"'engine.tensor_parallel' is 0; expected an integer ≥ 1"),
])
def test_bad_tensor_parallel_configs_are_one_clear_error(tmp_path, model, engine, message):
    cfg = job_dict(tmp_path, tmp_path)
    cfg["model"] = {k: v for k, v in {**LLAMA, **model}.items() if v is not None}
    cfg["engine"].update(engine)
    with pytest.raises(ShardstackError, match=message):
        load_config(write_job(tmp_path / "job.yaml", cfg))


def test_world_size_not_divisible_by_tp_is_a_clear_error(tmp_path, data_dir):
    cfg = load_config(write_job(tmp_path / "job.yaml", job_dict(tmp_path, data_dir, tp=2)))
    dist.init_distributed("cpu")
    try:
        with pytest.raises(ShardstackError, match=r"'engine.tensor_parallel' is 2, but the world size \(1\) is not "
                                                  r"divisible by it"):
            train(cfg, out=StringIO())
    finally:
        dist.shutdown()


# --- estimator --------------------------------------------------------------------------------------------------


def meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(ModelConfig.of(**LLAMA))


def expected_params(world: int, tp: int) -> int:
    """By hand: q/k/v/gate/up split on dim 0 and o/down on dim 1 across tp, then dim 0 across dp (all even here)."""
    split = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
             "o_proj.weight", "down_proj.weight")
    return FP32 * sum(p.numel() // (world if name.endswith(split) else world // tp)
                      for name, p in meta_llama().named_parameters())


def test_estimator_divides_the_split_projections_by_k():
    def est(world: int, tp: int):
        cfg = config_from_dict({"model": LLAMA, "engine": {"tensor_parallel": tp}, "batch": {"micro_batch": 2}})
        return estimate(cfg, world, stages=[3])[0]

    n_tensors = len(list(meta_llama().parameters()))
    for world, tp in ((4, 2), (2, 2), (4, 1), (2, 1)):
        e = est(world, tp)
        assert e.params == e.grads == expected_params(world, tp), (world, tp)
        assert e.optimizer == 2 * e.params + FP32 * n_tensors  # exp_avg, exp_avg_sq; a step scalar per tensor
    # At the same data-parallel size, TP 2 halves the projections' state. At the same world size FSDP alone
    # already splits everything 4 ways, so TP 2 × dp 2 holds more of the unsplit tensors, but gathers less for a
    # block and keeps less of its activations.
    assert est(4, 2).params < est(2, 1).params and est(4, 2).optimizer < est(2, 1).optimizer
    assert est(4, 2).params > est(4, 1).params
    assert est(4, 2).working_params < est(4, 1).working_params
    assert est(4, 2).activations < est(4, 1).activations
    with pytest.raises(ShardstackError, match=r"world size \(3\) is not divisible"):
        est(3, 2)
