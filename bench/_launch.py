"""Shared by the bench scripts: re-run the script under torchrun when it is started plainly, start a service and
wait until it is ready, describe the machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(cmd: list[str], ready: Callable[[], bool], *, timeout: float, what: str,
            env: dict | None = None) -> Iterator[int]:
    """Start `cmd`, poll `ready()` until it says yes, yield the pid; SIGTERM at the end (SIGKILL after 60 s)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited with {proc.returncode}:\n{proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not become ready in {timeout:.0f} s")
            time.sleep(0.2)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
