"""Activation checkpointing, per-block torch.compile and AdamW's kernels: configured with clear errors, applied
without changing parameter names or the math (GPT and Llama, on 2 gloo ranks at stage 3), and checkpointing
lowers the measured peak (alone at stage 0) — workers/options_worker.py, one run each for the whole module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.train.config import EngineConfig, config_from_dict
from shardstack.train.optim import make_optimizer, resolve_impl
from shardstack.train.parallelize import checkpointed_blocks, prepare_blocks

WORKER = Path(__file__).parent / "workers" / "options_worker.py"
# fused vs foreach vs for_loop: the same AdamW update evaluated in another order. Measured over the 4 steps: equal
# losses, weights ≤ 3e-7 apart (fused; for_loop matches foreach exactly). 1e-5 is the engine tests' parity bound.
IMPL_RTOL, IMPL_ATOL = 1e-5, 1e-5
# compile: inductor fuses LayerNorm, GELU and the residual adds and reorders their fp32 reductions, so activations
# differ by a few ulp. Measured over the 4 steps at stage 3: ≤ 9e-8 relative on the loss; 1e-5 on the weights,
# because AdamW's normalised update turns a few-ulp change of a near-zero gradient into a visible step. 10× margin.
COMPILE_RTOL, COMPILE_ATOL = 1e-6, 1e-4


# --- config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"activation_checkpointing": "every_n"}, "activation_checkpointing_every is not set"),
        ({"activation_checkpointing": "full", "activation_checkpointing_every": 2}, "applies to"),
        ({"activation_checkpointing": "every_n", "activation_checkpointing_every": 1}, "an integer ≥ 2"),
        ({"activation_checkpointing": "selective"}, "one of 'auto', 'none', 'full', 'every_n'"),
        ({"compile": "yes"}, "expected true/false"),
    ],
)
def test_engine_option_errors_name_the_key(engine, message):
    with pytest.raises(ShardstackError, match=message) as err:
        config_from_dict({"engine": engine})
    assert "'engine.activation_checkpointing" in str(err.value) or "'engine.compile'" in str(err.value)


def test_optimizer_impl_is_validated_and_outside_the_config_hash():
    with pytest.raises(ShardstackError, match=r"'optimizer\.impl'.*one of 'auto', 'fused', 'foreach', 'for_loop'"):
        config_from_dict({"optimizer": {"impl": "apex"}})
    # The kernels change how the update runs, not the run: a checkpoint resumes under another impl.
    assert config_from_dict({"optimizer": {"impl": "fused"}}).config_hash() == config_from_dict({}).config_hash()
    assert config_from_dict({"optimizer": {"lr": 1e-3}}).config_hash() != config_from_dict({}).config_hash()


# --- optimizer kernels ------------------------------------------------------------------------------------------


def test_auto_is_foreach_off_cuda_and_fused_is_checked_up_front():
    real = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert resolve_impl("auto", real) == "foreach"
    assert resolve_impl("fused", real) == "fused"
    opt = make_optimizer([{"params": real}], config_from_dict({"optimizer": {"impl": "for_loop"}}).optimizer, 0)
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (False, False)
    complex_param = [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]
    with pytest.raises(ShardstackError, match=r"'optimizer\.impl' is 'fused'.*complex64 on cpu") as err:
        resolve_impl("fused", complex_param)
    assert "foreach" in str(err.value)


# --- activation checkpointing, in this process ------------------------------------------------------------------


def test_checkpointed_blocks():
    assert checkpointed_blocks(5, "none", None) == []
    assert checkpointed_blocks(5, "full", None) == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, "every_n", 2) == [0, 2, 4]
    assert checkpointed_blocks(5, "every_n", 3) == [0, 3]


def test_blocks_stay_the_same_modules():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=8))
    blocks, keys = list(model.blocks), list(model.state_dict())
    prepare_blocks(model.blocks, EngineConfig(activation_checkpointing="full"), torch.device("cpu"))
    assert list(model.blocks) == blocks and all(type(b).__name__ == "Block" for b in model.blocks)
    assert list(model.state_dict()) == keys


# --- compile: the toolchain probe -------------------------------------------------------------------------------


def test_compile_without_a_working_compiler_is_a_clear_error(tmp_path):
    """A C++ compiler that does not exist (CXX) and an empty inductor cache: the probe must say so at build time."""
    code = (
        "from shardstack.errors import ShardstackError\n"
        "from shardstack.model.gpt import GPT, GPTConfig\n"
        "from shardstack.train.config import EngineConfig, OptimizerConfig\n"
        "from shardstack.train.dist import init_distributed\n"
        "from shardstack.train.engine import build_engine\n"
        "try:\n"
        "    build_engine(GPT(GPTConfig(n_layer=1, n_head=1, d_model=8, seq_len=4)), EngineConfig(stage=0, "
        "compile=True), OptimizerConfig(), init_distributed('cpu'))\n"
        "except ShardstackError as e:\n"
        "    print(e)\n"
        "    raise SystemExit(3)\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "'engine.compile' is true, but torch.compile cannot build kernels on cpu" in proc.stdout
    assert "engine.compile: false" in proc.stdout


# --- the same math, on 2 ranks at stage 3 ----------------------------------------------------------------------


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("options")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
          str(out), "3"])
    return [torch.load(out / f"stage3-rank{r}.pt", weights_only=False) for r in range(2)]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("base", ["base", "llama"])
def test_the_runs_train(runs, base):
    assert [r["world_size"] for r in runs] == [2, 2]
    v = runs[0]["variants"][base]
    assert v["losses"][-1] < v["losses"][0] and _max_diff(v["params"], v["initial"]) > 1e-3


@pytest.mark.parametrize(("variant", "base"), [("ac-full", "base"), ("ac-every2", "base"),
                                               ("llama-ac-full", "llama"), ("llama-ac-every2", "llama")])
def test_checkpointing_is_exact(runs, variant, base):
    """The recompute runs the same fp32 kernels on the same inputs: losses and weights are bit-identical."""
    for r in runs:
        assert r["variants"][variant]["losses"] == r["variants"][base]["losses"]
        assert _max_diff(r["variants"][variant]["params"], r["variants"][base]["params"]) == 0.0


@pytest.mark.parametrize("variant", ["fused", "for_loop"])
def test_optimizer_kernels_agree(runs, variant):
    for r in runs:
        assert r["variants"][variant]["losses"] == pytest.approx(r["variants"]["base"]["losses"], rel=IMPL_RTOL)
        assert _max_diff(r["variants"][variant]["params"], r["variants"]["base"]["params"]) < IMPL_ATOL


def test_compiled_blocks_match_eager(runs):
    problem = runs[0]["inductor_problem"]
    if problem:
        pytest.skip(f"inductor cannot build kernels on this machine: {problem}")
    for r in runs:
        v = r["variants"]["compile-ac-full"]
        assert v["graphs"] == 1  # compiled for real, and the 3 identical blocks share a graph
        assert v["losses"] == pytest.approx(r["variants"]["base"]["losses"], rel=COMPILE_RTOL)
        assert _max_diff(v["params"], r["variants"]["base"]["params"]) < COMPILE_ATOL


def test_parameter_names_do_not_depend_on_the_options(runs):
    for r in runs:
        keys = {name: v["keys"] for name, v in r["variants"].items()}
        for name, k in keys.items():
            assert k == keys["llama" if name.startswith("llama") else "base"], name


def test_zero_redundancy_optimizer_passes_the_kernels_through(runs):
    assert runs[0]["zero_defaults"] == {"fused": (True, False), "foreach": (False, True),
                                        "for_loop": (False, False)}


@pytest.mark.parametrize(("trip", "src"), [("ac_full_to_none", "ac-full"), ("none_to_every2", "base")])
def test_checkpoint_moves_between_ac_settings(runs, trip, src):
    """Saved with AC on, resumed with it off (and the reverse): every weight and AdamW state arrives, so the next
    step is bit-identical on both sides."""
    for r in runs:
        t = r[trip]
        assert _max_diff(t["loaded"], r["variants"][src]["params"]) == 0.0
        assert t["loss_dst"] == t["loss_src"]
        assert _max_diff(t["after_dst"], t["after_src"]) == 0.0


# --- checkpointing lowers the measured peak ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mem(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mem")
    _run([sys.executable, str(WORKER), str(out), "mem"])
    return torch.load(out / "mem.pt", weights_only=False)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_checkpointing_lowers_the_measured_peak(mem, arch):
    """One forward/backward at stage 0 with activations far above the noise (4 blocks, 16–21 MiB each): full
    checkpointing gives the same loss, and the peak RSS it adds falls by what the estimator's activations say,
    within 25% of that drop."""
    none, full = mem[f"{arch}-none"], mem[f"{arch}-full"]
    assert full["loss"] == none["loss"]
    measured, estimated = none["peak"] - full["peak"], none["activations"] - full["activations"]
    assert full["peak"] < none["peak"]
    assert measured == pytest.approx(estimated, rel=0.25), (none, full)
