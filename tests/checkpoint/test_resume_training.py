"""Acceptance tests against the real trainer under torchrun (CPU, gloo, fp32).

One reference run (2 processes, stage 3, 10 steps, a checkpoint every 5) gives the loss sequence; every resumed
run must continue it within 1e-5 relative, whatever its world size or stage, because the checkpoint carries the
model, optimizer, scheduler, step, RNG and the global sample position, and the global batch stays the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from shardstack.signing import SigningKey
from shardstack.train.checkpoint.layout import list_checkpoints, resolve_checkpoint, verify_checkpoint

from .conftest import HERE, start_group, stop_group, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
INTERVAL = 5
ENTRY = str(HERE / "train_entry.py")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardstack.train.data import prepare

    out = tmp_path_factory.mktemp("data")
    prepare(None, out)  # the corpus shipped with shardstack
    return out


def job(tmp: Path, data: Path, ckpt: Path, key_file: Path, *, world: int, stage: int, total_steps: int = 10,
        interval: int = INTERVAL) -> Path:
    cfg = {
        "name": "resume",  # one job across these config files (their stems differ)
        "model": {"size": "tiny", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32},
        "data": {"path": str(data)},
        "engine": {"stage": stage, "precision": "fp32", "device": "cpu"},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "total_steps": total_steps},
        "batch": {"global_batch": GLOBAL_BATCH, "micro_batch": GLOBAL_BATCH // world},
        "checkpoint": {"dir": str(ckpt), "interval": interval, "keep": 3, "signing_key_file": str(key_file)},
        "metrics": {"port": 0},
        "seed": 7,
    }
    path = tmp / f"job-{world}-{stage}-{ckpt.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(output: str) -> dict[int, float]:
    """The per-step JSON lines rank 0 prints; a later line for the same step (after a restart) wins."""
    out = {}
    for line in output.splitlines():
        if line.startswith('{"step"'):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def train(nproc: int, config: Path, *extra: str, **kw) -> str:
    rc, out = torchrun(nproc, ENTRY, "--config", str(config), *extra, **kw)
    assert rc == 0, out[-4000:]
    return out


def assert_continues(resumed: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(resumed) == list(steps), resumed
    for step in steps:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), (step, resumed, reference)


def resumed_step(output: str) -> int:
    m = re.search(r"(?:elastic restart \d+: )?resumed from \S+step_(\d{8}) \(step (\d+)", output)
    assert m, output[-4000:]
    return int(m.group(2))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path,
              key_file: Path) -> tuple[Path, dict[int, float], Path]:
    tmp = tmp_path_factory.mktemp("reference")
    out = train(2, job(tmp, data_dir, tmp / "ckpt", key_file, world=2, stage=3))
    ref = losses(out)
    assert sorted(ref) == list(range(1, 11))
    assert [s for s, _ in list_checkpoints(tmp / "ckpt")] == [5, 10]
    return tmp / "ckpt", ref, data_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resume_on_1_process_after_the_newest_checkpoint_was_truncated(
    reference, tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    root, ref, data = reference
    ckpt = _copy(root, tmp_path / "ckpt")
    shard = ckpt / "step_00000010" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    out = train(1, job(tmp_path, data, ckpt, key_file, world=1, stage=3))
    assert re.search(r"skipping checkpoint \S+step_00000010: size mismatch for __1_0\.distcp", out), out[-4000:]
    assert resumed_step(out) == 5
    assert_continues(losses(out), ref, range(6, 11))
    assert verify_checkpoint(ckpt / "step_00000010", key=key).valid  # the damaged one was saved again by this run
    assert (ckpt / "step_00000010.invalid-size-mismatch").is_dir()  # and kept aside, not deleted


def test_resume_on_4_processes_at_stage_1_after_a_shard_was_altered(reference, tmp_path: Path, key_file: Path) -> None:
    root, ref, data = reference
    ckpt = _copy(root, tmp_path / "ckpt")
    shard = ckpt / "step_00000010" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit, same size
    shard.write_bytes(bytes(raw))
    out = train(4, job(tmp_path, data, ckpt, key_file, world=4, stage=1))
    assert re.search(r"skipping checkpoint \S+step_00000010: checksum mismatch for __0_0\.distcp", out), out[-4000:]
    assert re.search(r"\(step 5, saved by 2 ranks at stage 3; now 4 ranks\)", out), out[-4000:]
    assert_continues(losses(out), ref, range(6, 11))


def test_3_processes_at_stage_1_reshard_to_2_processes_at_stage_3(
    reference, tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    _root, ref, data = reference
    ckpt = tmp_path / "ckpt"
    first = train(3, job(tmp_path, data, ckpt, key_file, world=3, stage=1), "--max-steps", "5")
    assert_continues(losses(first), ref, range(1, 6))  # the loss sequence does not depend on the world size
    manifest = verify_checkpoint(ckpt / "step_00000005", key=key).manifest
    assert manifest is not None and (manifest["world_size"], manifest["stage"]) == (3, 1)
    second = train(2, job(tmp_path, data, ckpt, key_file, world=2, stage=3))
    assert re.search(r"\(step 5, saved by 3 ranks at stage 1; now 2 ranks\)", second), second[-4000:]
    assert_continues(losses(second), ref, range(6, 11))


def test_a_crash_while_saving_never_leaves_a_checkpoint_that_resume_picks(
    reference, tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    _root, ref, data = reference
    ckpt = tmp_path / "ckpt"
    config = job(tmp_path, data, ckpt, key_file, world=2, stage=3)
    os.environ["SHARDSTACK_TEST_DIE_IN_SAVE"] = "1:10"  # rank 1 dies half-way through writing step 10's shard
    try:
        rc, out = torchrun(2, ENTRY, "--config", str(config))
    finally:
        del os.environ["SHARDSTACK_TEST_DIE_IN_SAVE"]
    assert rc != 0, out[-4000:]
    leftovers = sorted(p.name for p in ckpt.iterdir())
    assert leftovers[0] == "step_00000005" and re.fullmatch(r"step_00000010\.tmp-[0-9a-f]+", leftovers[1]), leftovers
    assert len(leftovers) == 2
    partial = ckpt / leftovers[1]
    assert (partial / "__1_0.distcp").exists() and not (partial / "manifest.json").exists()
    assert resolve_checkpoint(ckpt, key=key).step == 5
    out = train(2, config)
    assert resumed_step(out) == 5 and "never finished" in out
    assert_continues(losses(out), ref, range(6, 11))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000005", "step_00000010"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_pid(agent_pid: int, rank: int) -> int | None:
    """The worker process of `rank` that torchrun's agent started (its direct child with RANK in its env)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def test_kill_9_of_a_worker_under_torchrun_restarts_from_the_newest_checkpoint(
    data_dir: Path, tmp_path: Path, key_file: Path
) -> None:
    total = 80  # long enough that the kill at step ≥ 8 lands while training still runs, even on a fast machine
    config = job(tmp_path, data_dir, tmp_path / "ckpt", key_file, world=2, stage=3, total_steps=total)
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "ckpt-elastic", "--monitor-interval", "0.5", ENTRY, "--config", str(config)]
    log_path = tmp_path / "torchrun.log"
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    killed_at = None
    with open(log_path, "w") as log:
        # LOGLEVEL=INFO makes torchrun's agent log its restart decisions.
        proc = start_group(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={"LOGLEVEL": "INFO"})
        watchdog = threading.Timer(300, stop_group, [proc])  # a hung restart must fail the test, not stall it
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith('{"step"'):
                    continue
                rec = json.loads(line)
                (after if killed_at is not None else before)[rec["step"]] = rec["loss"]
                if killed_at is None and rec["step"] >= INTERVAL + 3:
                    pid = _worker_pid(proc.pid, rank=1)
                    assert pid is not None, "no rank-1 worker found"
                    os.kill(pid, signal.SIGKILL)
                    killed_at = rec["step"]
            rc = proc.wait(timeout=60)
        finally:
            watchdog.cancel()
            stop_group(proc)
    text = log_path.read_text()
    assert rc == 0, text[-4000:]
    assert killed_at is not None
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", text), text[-4000:]
    assert re.search(r"Worker group FAILED\. \d/3 attempts left; will restart worker group", text), text[-4000:]
    # One restart is enough: the restarted group must come up cleanly (no stale rendezvous state).
    assert re.search(r"elastic restart 1: resumed from \S+step_\d{8}", text), text[-4000:]
    assert "connectFullMesh failed" not in text and "elastic restart 2" not in text, text[-4000:]
    restart = resumed_step(text)
    last_before = max(before)  # the newest step rank 0 reported before the kill took the group down
    assert restart % INTERVAL == 0 and 0 < last_before - restart <= INTERVAL, (restart, last_before)
    assert max(after) == total and sorted(after) == list(range(restart + 1, total + 1))
    for step in range(restart + 1, last_before + 1):  # the recomputed steps repeat the lost ones exactly
        assert after[step] == pytest.approx(before[step], rel=1e-5), (step, before, after)
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")][-1] == total


def test_sigterm_to_torchrun_saves_a_checkpoint_at_the_current_step_and_the_next_run_resumes_there(
    data_dir: Path, tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    """What `systemctl stop` (SIGTERM to torchrun, forwarded to the workers) and `scancel` (SIGTERM to every
    process of the job) do: the ranks agree on a step, save it and leave with exit code 0; nothing is lost."""
    data = data_dir
    total = 400  # far more than the test lets it run: the stop must come from the signal
    # No interval checkpoint at any step before `total`: however far the run gets before the signal is handled
    # (a loaded host), the only checkpoint it can leave is the one SIGTERM makes at the step it stopped on.
    interval = total
    ckpt = tmp_path / "ckpt"
    config = job(tmp_path, data, ckpt, key_file, world=2, stage=3, total_steps=total, interval=interval)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", ENTRY,
           "--config", str(config)]
    seen: list[int] = []
    proc = start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, stop_group, [proc])
    watchdog.start()
    output = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith('{"step"'):
                seen.append(json.loads(line)["step"])
                if len(seen) == 3:
                    os.kill(proc.pid, signal.SIGTERM)  # the agent only, as systemd's KillMode=mixed does
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        stop_group(proc)
    text = "".join(output)
    m = re.search(r"stopping after step (\d+) on SIGTERM", text)
    assert m, text[-4000:]
    stopped = int(m.group(1))
    assert seen[2] <= stopped < total, (seen, stopped)  # at or after the step it was sent at; not the schedule's end
    # Saved at the stop, and only there: no interval fell before it, so this is the signal's checkpoint.
    assert [s for s, _ in list_checkpoints(ckpt)] == [stopped]
    assert verify_checkpoint(ckpt / f"step_{stopped:08d}", key=key).valid
    # Training on past the old end changes schedule.total_steps, which the config hash covers: the flag says so.
    again = train(2, job(tmp_path, data, ckpt, key_file, world=2, stage=3, total_steps=10 + stopped,
                         interval=interval), "--allow-config-change")
    assert resumed_step(again) == stopped
    assert sorted(losses(again)) == list(range(stopped + 1, stopped + 11))
