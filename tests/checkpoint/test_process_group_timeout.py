"""The process group's timeout comes from SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS (the training_runtime role's
train.env): torch's default, 10 minutes, is shorter than a checkpoint save on NFS can keep the other ranks waiting
in a collective. Each case joins a real group in a fresh process (alone, and as torchrun's env:// would)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

PROBE = """
import torch, torch.distributed as dist
from shardstack.train.dist import init_distributed
init_distributed("cpu")
print(int(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()),
      int(dist.distributed_c10d._get_default_timeout("gloo").total_seconds()))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout(value: str | None, launcher: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS")}
    env["PYTHONPATH"] = str(RUNTIME)
    if value is not None:
        env["SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS"] = value
    if launcher:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


ASYNC_PROBE = """
import dataclasses, torch
from shardstack.train.checkpoint.checkpointer import Checkpointer
from shardstack.train.config import CheckpointConfig
from shardstack.train.dist import init_distributed
init_distributed("cpu")
cfg = CheckpointConfig(dir={root!r}, async_save=True, require_signature=False)
ckpt = Checkpointer(cfg, config_hash="cafe", job="j", stage=3, job_config={{}})
print(int(ckpt._pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()))
"""


def test_the_async_save_group_has_the_same_timeout(tmp_path: Path) -> None:
    """Async saves run their collectives on a gloo group of their own, which does not inherit the default group's
    timeout: they are the ones that wait on NFS."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(RUNTIME), SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS="2700", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, "-c", ASYNC_PROBE.format(root=str(tmp_path / "ckpt"))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "2700"


@pytest.mark.parametrize("launcher", [False, True])
def test_the_group_waits_as_long_as_the_role_says(launcher: bool) -> None:
    done = _timeout("1800", launcher)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2] == "1800"


def test_unset_keeps_torchs_default_and_nonsense_is_refused() -> None:
    done = _timeout(None, False)
    assert done.returncode == 0, done.stderr
    used, default = done.stdout.split()[-2:]
    assert used == default  # torch's own (gloo's here; NCCL's is 10 minutes)
    bad = _timeout("ten minutes", False)
    assert bad.returncode != 0 and "SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS is 'ten minutes'" in bad.stderr
