"""The trainer end to end: alone in this process (world size 1) and under torchrun with 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from io import StringIO
from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.spec import build_model
from shardstack.train import dist
from shardstack.train.config import config_from_dict
from shardstack.train.data import prepare
from shardstack.train.memory.estimate import estimate
from shardstack.train.metrics import TrainMetrics
from shardstack.train.optim import lr_lambda
from shardstack.train.trainer import train

TINY = {"size": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 32}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    prepare(None, out)
    return out


@pytest.fixture
def world1():
    torch.set_num_threads(1)
    info = dist.init_distributed("cpu")
    yield info
    dist.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_schedule_warmup_then_cosine():
    f = lr_lambda(4, 14, 0.1)
    assert [round(f(s), 3) for s in (0, 3)] == [0.2, 0.8]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1)
    assert f(100) == pytest.approx(0.1)


def test_train_alone_learns_and_logs(world1, data_dir):
    cfg = config_from_dict({
        "model": TINY, "data": {"path": str(data_dir)}, "engine": {"stage": 3},
        "batch": {"global_batch": 4, "micro_batch": 2}, "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "total_steps": 100}, "metrics": {"port": 0, "peak_tflops": 1.0},
    })
    out = StringIO()
    res = train(cfg, max_steps=25, out=out)
    assert res.steps == list(range(1, 26)) and res.accumulation == 2
    assert sum(res.losses[-5:]) / 5 < res.losses[0] - 1.0  # bytes of English: far below ln(256) quickly
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["step"] for x in lines] == res.steps
    assert set(lines[0]) >= {"step", "loss", "lr", "tokens_per_second", "step_seconds", "mfu", "memory_bytes"}
    assert 0 < lines[-1]["mfu"] < 1 and lines[-1]["tokens_per_second"] > 0
    m, e = res.memory_measured, res.memory_estimated
    assert abs(m["total"] - e["total"]) <= 0.05 * e["total"]


@pytest.mark.parametrize("engine", [
    {"stage": 3, "offload": "cpu", "precision": "bf16", "prefetch": 2},
    {"stage": 2, "precision": "fp16", "accumulation_sync": "every"},
    {"stage": 1, "precision": "bf16"},
])
def test_train_engine_options(world1, data_dir, engine):
    cfg = config_from_dict({
        "model": TINY, "data": {"path": str(data_dir)}, "engine": engine,
        "batch": {"global_batch": 4, "micro_batch": 2}, "schedule": {"warmup_steps": 0, "total_steps": 10},
        "optimizer": {"lr": 3e-3},
        "metrics": {"port": 0, "peak_tflops": 1.0},
    })
    res = train(cfg, max_steps=4, out=StringIO())
    assert len(res.losses) == 4 and all(math.isfinite(x) for x in res.losses) and res.losses[-1] < res.losses[0]
    assert res.memory_measured["on_cpu"] == res.memory_measured["total"]  # CPU run: everything is host memory
    assert abs(res.memory_measured["total"] - res.memory_estimated["total"]) <= 0.05 * res.memory_estimated["total"]


def test_user_model_factory(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "workers"))
    cfg = config_from_dict({"model": {"factory": "user_model:make", "factory_kwargs": {"layers": 3}}})
    model = build_model(cfg.model)
    assert type(model).__name__ == "Wide" and len(model.blocks) == 3
    assert estimate(cfg, 2, stages=[3])[0].params == 4 * sum(p.numel() for p in model.parameters()) // 2
    with pytest.raises(ShardstackError, match=r"'model\.factory': cannot load 'no_such_module:make'"):
        build_model(config_from_dict({"model": {"factory": "no_such_module:make"}}).model)


def test_metrics_endpoint_serves_the_gauges():
    port = _free_port()
    m = TrainMetrics(port, addr="127.0.0.1")
    try:
        m.update(step=7, end=10, loss=2.5, step_seconds=0.25, tokens_per_second=1000.0, mfu=0.4)
        m.last_checkpoint_step.set(5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    for name, value in [("shardstack_train_step", "7.0"), ("shardstack_train_loss", "2.5"),
                        ("shardstack_train_step_seconds", "0.25"), ("shardstack_train_tokens_per_second", "1000.0"),
                        ("shardstack_train_mfu_ratio", "0.4"), ("shardstack_train_end_step", "10.0"),
                        ("shardstack_train_last_checkpoint_step", "5.0")]:
        assert f"\n{name} {value}\n" in body
    assert "shardstack_train_last_step_timestamp_seconds " in body


@pytest.mark.parametrize(("under_torchrun", "own_process"), [(True, False), (False, True), (False, False)])
def test_leave_worker_ends_a_torchrun_worker_or_a_process_of_its_own_and_flushes_first(under_torchrun, own_process):
    code = ("import logging, sys\nfrom shardstack.train.dist import leave_worker\n"
            "logging.basicConfig(); logging.getLogger('t').warning('logged')\n"
            f"sys.stdout.write('printed'); leave_worker(3, own_process={own_process}); print(' and returned')")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if under_torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "logged" in proc.stderr
    if under_torchrun or own_process:  # the block-buffered pipe was flushed before os._exit
        assert (proc.returncode, proc.stdout) == (3, "printed")
    else:
        assert (proc.returncode, proc.stdout) == (0, "printed and returned\n")


def test_only_the_shardstack_program_owns_its_process():
    code = ("import shardstack.cli as c\nprint(c.owns_process())\n"
            "c.main = lambda: print(c.owns_process()) or 4\nc.entry()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (4, ["False", "True"])


@pytest.mark.distributed
def test_cli_under_torchrun_two_ranks(tmp_path, data_dir):
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {json.dumps(TINY)}\n"
        f"data: {{path: {data_dir}}}\n"
        "engine: {stage: 2, precision: bf16}\n"
        "batch: {global_batch: 8, micro_batch: auto, cpu_memory_budget_mb: 4096}\n"
        "schedule: {warmup_steps: 1, total_steps: 50}\n"
        f"metrics: {{port: {_free_port()}, peak_tflops: 1.0, json_log: {tmp_path / 'steps.jsonl'}}}\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "shardstack", "train", "run", "--config", str(job), "--max-steps", "3"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if " shardstack." in line]
    assert "CPU+gloo, world size 2" in ours[0]  # the first thing a run says is what it runs on
    assert "micro_batch auto: 4" in proc.stderr  # the whole per-rank batch fits 4 GiB: accumulation 1
    steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3]  # rank 0 only
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 3
