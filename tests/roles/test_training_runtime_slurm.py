"""The batch script the training_runtime role writes for Slurm, run by bash against stand-ins for Slurm's commands
(scontrol, srun) and the step's (systemd-cat, torchrun) that record what they were given: what srun asks for, and
what the torchrun agent is started with."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

# Each stand-in writes its argv (and, for torchrun, its signal dispositions) as one JSON line to $RECORD.
_RECORDER = """#!/usr/bin/env python3
import json, os, sys
name = os.path.basename(sys.argv[0])
entry = {"name": name, "argv": sys.argv[1:]}
if name == "torchrun":
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    entry["sig_ign"] = int(status["SigIgn"].strip(), 16)
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(entry) + "\\n")
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print("gpu01\\ngpu02")
elif name == "scontrol" and sys.argv[1:3] == ["show", "job"]:
    print(f"   PreemptEligibleTime=None PreemptTime={os.environ.get('PREEMPT_TIME', 'None')} SuspendTime=None")
elif name == "scontrol" and sys.argv[1:3] == ["show", "node"]:
    print("   NodeAddr=192.0.2.11 NodeHostName=gpu01")
elif name == "srun":  # runs the step's command here, as the task on one node would
    argv = sys.argv[1:]
    while argv and argv[0].startswith("--"):
        argv.pop(0)
    os.execvp(argv[0], argv)
elif name == "systemd-cat" and sys.argv[2:]:
    os.execvp(sys.argv[2], sys.argv[2:])
elif name == "systemd-cat":
    sys.stdout.write(sys.stdin.read())
"""


def _run(tmp_path: Path, role_eval: Any, debian_container: dict, env: dict[str, str],
         **overrides: Any) -> tuple[str, list[dict[str, Any]]]:
    venv = tmp_path / "venv"
    conf = tmp_path / "etc"
    bindir = tmp_path / "bin"
    for d in (venv / "bin", conf, bindir):
        d.mkdir(parents=True, exist_ok=True)
    (conf / "train.env").write_text("PYTHONUNBUFFERED=1\n")
    for name, where in (("scontrol", bindir), ("srun", bindir), ("systemd-cat", bindir), ("torchrun", venv / "bin")):
        (where / name).write_text(_RECORDER)
        (where / name).chmod(0o755)
    text = role_eval("training_runtime", debian_container, training_runtime_job_name="run1",
                     training_runtime_venv=str(venv), training_runtime_config_dir=str(conf),
                     **overrides).render("job.sbatch.j2")
    script = tmp_path / "run1.sbatch"
    script.write_text(text)
    record = tmp_path / "record.jsonl"
    full_env = {"PATH": f"{bindir}:{os.environ['PATH']}", "RECORD": str(record), "SLURM_JOB_ID": "41",
                "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "gpu01",
                "SLURM_GPUS_ON_NODE": "8", **env}
    done = subprocess.run(["bash", str(script)], env=full_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return text, [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.parametrize(("cpus_per_node", "want"), [("224(x2)", "224"), ("224,192", "192"), ("128(x3),96(x2)", "96")])
def test_the_step_gets_every_cpu_of_the_job_unbound(tmp_path: Path, role_eval: Any, debian_container: dict,
                                                      cpus_per_node: str, want: str) -> None:
    """Without -c srun gives the step one CPU, which ConstrainCores=yes then confines every worker to."""
    _, calls = _run(tmp_path, role_eval, debian_container, {"SLURM_JOB_CPUS_PER_NODE": cpus_per_node})
    srun = next(c for c in calls if c["name"] == "srun")
    assert srun["argv"][:4] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", f"--cpus-per-task={want}",
                                "--cpu-bind=none"]
    torchrun = next(c for c in calls if c["name"] == "torchrun")
    assert "--nproc-per-node=8" in torchrun["argv"] and "--nnodes=2" in torchrun["argv"]


def test_workers_get_sigusr1_the_grace_before_the_limit_and_the_agent_survives_it(
    tmp_path: Path, role_eval: Any, debian_container: dict
) -> None:
    """sbatch --signal=USR1@grace without B: Slurm signals every process of the steps; the agent must ignore it (its
    default action is to die, killing the workers mid-save), and must wait the grace, not 30 s, after SIGTERM."""
    text, calls = _run(tmp_path, role_eval, debian_container, {"SLURM_JOB_CPUS_PER_NODE": "8"},
                       training_runtime_checkpoint_grace_seconds=600)
    lines = text.splitlines()
    directive = lines.index("#SBATCH --signal=USR1@600")
    # sbatch reads #SBATCH lines only before the script's first command.
    assert all(line.startswith("#") for line in lines[:directive])
    torchrun = next(c for c in calls if c["name"] == "torchrun")
    assert torchrun["sig_ign"] & (1 << (10 - 1)), "SIGUSR1 (10) is not ignored by the torchrun agent"
    assert "--shutdown-timeout=600" in torchrun["argv"]


@pytest.mark.parametrize(("node", "preempt_time", "requeued"), [("gpu01", "None", False),
                                                                ("gpu01", "2026-12-04T22:10:00", True),
                                                                ("gpu02", "2026-12-04T22:10:00", False)])
def test_a_preempted_job_requeues_itself_from_its_head_node_once_the_agent_has_stopped(
    tmp_path: Path, role_eval: Any, debian_container: dict, node: str, preempt_time: str, requeued: bool
) -> None:
    """Slurm 22.05 (Debian 12) ends a preempted job that stops at its checkpoint within GraceTime as COMPLETED; the
    step's shell, which ignores SIGTERM to outlive the agent, asks for the requeue when the controller has set
    the job's PreemptTime. A job stopped by scancel or its time limit (no PreemptTime) is not requeued."""
    _, calls = _run(tmp_path, role_eval, debian_container, {"SLURM_JOB_CPUS_PER_NODE": "8", "SLURMD_NODENAME": node,
                                                            "PREEMPT_TIME": preempt_time})
    names = [c["name"] for c in calls]
    requeues = [c["argv"] for c in calls if c["name"] == "scontrol" and c["argv"][:1] == ["requeue"]]
    assert requeues == ([["requeue", "41"]] if requeued else [])
    if requeued:
        assert names.index("torchrun") < len(names) - 1 - names[::-1].index("scontrol")
    torchrun = next(c for c in calls if c["name"] == "torchrun")
    assert torchrun["sig_ign"] & (1 << (15 - 1)), "SIGTERM (15) reaches the step's shell, which must outlive the agent"


def test_the_grace_defaults_fit_in_slurms_kill_wait(role_eval: Any, debian_container: dict) -> None:
    grace = int(role_eval("training_runtime", debian_container)["training_runtime_checkpoint_grace_seconds"])
    slurm = role_eval("slurm", debian_container)
    assert grace >= 300
    # SIGTERM (scancel, requeue, time limit): torchrun waits `grace` for its workers inside KillWait.
    assert int(slurm["slurm_kill_wait"]) >= grace + 30
    assert int(slurm["slurm_preempt_grace_time"]) >= grace


def test_the_systemd_unit_waits_the_grace_too(role_eval: Any, debian_container: dict) -> None:
    unit = role_eval("training_runtime", debian_container, __training_runtime_nproc=8,
                     training_runtime_checkpoint_grace_seconds=400).render("shardstack-train@.service.j2")
    assert "--shutdown-timeout=400" in unit
    assert "TimeoutStopSec=430" in unit.splitlines()


def test_train_env_sets_the_process_group_timeout(role_eval: Any, debian_container: dict) -> None:
    """Both schedulers read train.env (the unit's EnvironmentFile=, the batch script's step sources it)."""
    env = role_eval("training_runtime", {**debian_container, "processor_vcpus": 16}, __training_runtime_nproc=8,
                    __training_runtime_ifname="").render("train.env.j2")
    assert "SHARDSTACK_PROCESS_GROUP_TIMEOUT_SECONDS=1800" in env.splitlines()
