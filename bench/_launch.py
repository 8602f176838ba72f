"""Shared by the bench scripts: re-run the script under torchrun when it is started plainly, and build models."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(world_size: int, argv: list[str], python: str | None = None, env: dict | None = None) -> int:
    """Run this script again as `world_size` gloo ranks (torchrun --standalone) and return its exit code."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world_size), sys.argv[0], *argv]
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    return subprocess.run(cmd, env=full_env).returncode


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} × {cpu}, {gpu}, torch {torch.__version__}"
