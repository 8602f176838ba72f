"""`shardstack train` under Slurm, the parts that need no cluster: squeue/sacct output read into a job state, the
options checked before anything runs, and the batch script the role writes (molecule slurm runs it for real)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from shardstack.errors import ShardstackError
from shardstack.ops import train
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import JobStatus, identifier
from shardstack.ops.jobs.slurm import SlurmJob, parse_slurm_job, state_of

from .conftest import render


def test_the_newest_job_of_squeue_or_sacct_output() -> None:
    text = ("41|COMPLETED|None|00:01:10|2|node[1-2]|product|normal|2026-12-01T23:29:37\n"
            "junk line\n"
            "43|PENDING|QOSMaxNodePerJobLimit|00:00:00|2||research|small|N/A\n"
            "42|CANCELLED by 0|None|00:00:09|1|node1|research|normal|2026-12-01T23:31:02\n")
    newest = parse_slurm_job(text)
    assert newest == SlurmJob("43", "PENDING", "QOSMaxNodePerJobLimit", "00:00:00", 2, "", "research", "small", "N/A")
    assert parse_slurm_job("") is None and parse_slurm_job("JobID|State\n") is None
    # The journal is read from the current run's start: none while pending (a start time then is an estimate).
    assert newest.started is None
    assert parse_slurm_job(text.splitlines()[0]).started == "2026-12-01 23:29:37"
    assert SlurmJob("7", "PENDING", "Priority", "0:00", 2, "", "a", "q", "2026-12-02T01:00:00").started is None


@pytest.mark.parametrize(("state", "want"), [
    ("PENDING", "pending"), ("REQUEUED", "pending"), ("CONFIGURING", "pending"),
    ("RUNNING", "running"), ("COMPLETING", "running"),
    ("COMPLETED", "finished"), ("CANCELLED by 0", "stopped"), ("CANCELLED+", "stopped"),
    ("FAILED", "failed"), ("NODE_FAIL", "failed"), ("TIMEOUT", "failed"), ("OUT_OF_MEMORY", "failed"),
])
def test_slurm_states_read_as_the_systemd_paths(state: str, want: str) -> None:
    job = SlurmJob("7", state, "None", "00:00:01", 2, "n[1-2]", "a", "q")
    st = JobStatus("j", state_of(job), scheduler="slurm", slurm=job)
    assert st.state == want
    assert st.to_dict()["slurm"]["state"] == state and st.to_dict()["scheduler"] == "slurm"


def test_no_slurm_job_of_that_name_is_unknown_and_steps_come_from_the_journals() -> None:
    assert state_of(None) == "unknown"
    steps = {"n1": {"step": 40, "loss": 2.0}, "n2": {"step": 12, "loss": 3.0}}
    st = JobStatus("j", "running", scheduler="slurm", steps=steps)
    assert st.last_step == {"step": 40, "loss": 2.0}


def _inventory(tmp_path: Path, scheduler: str) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {
        "vars": {"shardstack_scheduler": scheduler},
        "children": {"train_nodes": {"hosts": {"t1": {"ansible_host": "192.0.2.1"}}},
                     "slurm_controller": {"hosts": {"t1": {}}}}}}))
    return path


def test_the_scheduler_is_the_inventorys(tmp_path: Path) -> None:
    assert Cluster.load(_inventory(tmp_path, "slurm")).scheduler == "slurm"
    with pytest.raises(ShardstackError, match="shardstack_scheduler is 'cron'"):
        _ = Cluster.load(_inventory(tmp_path, "cron")).scheduler


@pytest.mark.parametrize(("scheduler", "options", "message"), [
    ("systemd", {"account": "research"}, r"--account need Slurm; this cluster's shardstack_scheduler is systemd"),
    ("systemd", {"qos": "high", "time_limit": "1:00:00"}, r"--qos/--time need Slurm"),
    ("slurm", {"qos": "high; rm -rf /"}, r"--qos 'high; rm -rf /' is not valid"),
    ("slurm", {"account": "-x"}, r"--account '-x' is not valid"),
    ("slurm", {"time_limit": "forever"}, r"--time 'forever' is not valid"),
])
def test_slurm_options_are_checked_before_anything_runs(tmp_path: Path, scheduler: str, options: dict,
                                                         message: str) -> None:
    with pytest.raises(ShardstackError, match=message):
        train.submit({}, "job", Cluster.load(_inventory(tmp_path, scheduler)), **options)


def test_slurm_names_and_time_limits() -> None:
    assert all(train.SLURM_TIME.match(t) for t in ("30", "2:00:00", "1-12:00:00", "90:00"))
    assert not any(train.SLURM_TIME.match(t) for t in ("", "1h", "1-", "12:0:00"))
    assert train.SLURM_NAME.match("team_a.prod-1") and not train.SLURM_NAME.match("-x")


SBATCH_VARS = {"training_runtime_job_name": "run1", "training_runtime_user": "shardstack"}


def test_the_batch_script_is_bash_and_runs_one_torchrun_agent_per_node(tmp_path: Path) -> None:
    text = render("training_runtime", "job.sbatch.j2", **SBATCH_VARS)
    script = tmp_path / "run1.sbatch"
    script.write_text(text)
    assert text.startswith("#!/bin/bash\n")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    # The command srun runs on every node is a script of its own: bash must read it too.
    inner = re.search(r"/bin/bash -c '(.*)'\s*$", text, re.S)
    assert inner, text
    assert subprocess.run(["bash", "-n", "-c", inner.group(1)], capture_output=True, text=True).returncode == 0
    assert "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 " in text
    argv = inner.group(1)
    for part in ("set -a; . /etc/shardstack/train.env; set +a",
                 "systemd-cat --identifier=shardstack-train-run1",
                 "/opt/shardstack/venv/bin/torchrun",
                 '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="${SLURM_GPUS_ON_NODE:-1}"',
                 '--rdzv-endpoint="$SHARDSTACK_RDZV_ENDPOINT" --rdzv-id="$SHARDSTACK_RDZV_ID"',
                 "--max-restarts=0",
                 "-m shardstack train run --config /etc/shardstack/jobs/run1.yaml"):
        assert part in argv, part
    # The rendezvous: on the job's first node, a fresh id for every run (a requeue is another run).
    assert 'SHARDSTACK_RDZV_ENDPOINT="${head_addr}:29400"' in text
    assert 'SHARDSTACK_RDZV_ID="${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"' in text
    assert identifier("run1") == "shardstack-train-run1"


SUBMIT = yaml.safe_load((Path(__file__).resolve().parents[2] / "playbooks" / "train_submit.yml").read_text())
GROUPS = {"train_nodes": ["t1", "t2", "t3"], "all": ["t1", "t2", "t3"]}


def _value(expression: str, **variables) -> object:
    from ansible.template import trust_as_template

    from .conftest import _templar

    return _templar("training_runtime", {"groups": GROUPS, **variables}).template(trust_as_template(expression))


@pytest.mark.parametrize(("variables", "scheduler", "hosts"), [
    ({}, None, "t1,t2,t3"),
    ({"train_job_nodes": 1}, None, "t1"),
    ({"train_job_exclude": ["t1"], "train_job_nodes": 1}, "systemd", "t2"),
    # Slurm places the job: every eligible node gets its config, sbatch asks for the number of nodes. The scheduler
    # comes from the nodes' own variables (group_vars), which a play's `hosts:` could not read.
    ({"train_job_nodes": 1}, "slurm", "t1,t2,t3"),
    ({"train_job_exclude": ["t2"]}, "slurm", "t1,t3"),
    ({"train_job_exclude": ["t1", "t2", "t3"]}, None, ""),
])
def test_the_submit_play_runs_on_the_nodes_its_scheduler_needs(variables: dict, scheduler: str | None,
                                                               hosts: str) -> None:
    choose = SUBMIT[0]
    known = {"hostvars": {h: {"shardstack_scheduler": scheduler} if scheduler else {} for h in GROUPS["all"]},
             **variables}
    for name in ("__eligible", "__nodes", "__scheduler"):
        known[name] = _value(choose["vars"][name], **known)
    add = next(t for t in choose["tasks"] if "ansible.builtin.add_host" in t)
    assert ",".join(_value(add["loop"], **known)) == hosts
    assert SUBMIT[1]["hosts"] == add["ansible.builtin.add_host"]["groups"]


def test_the_slurm_job_asks_for_its_nodes_gpus_and_excludes_cordoned_ones_by_address() -> None:
    slurm = next(t for t in SUBMIT[1]["tasks"] if t["ansible.builtin.include_role"]["tasks_from"] == "slurm_job.yml")
    given = slurm["vars"]
    hostvars = {"t1": {"ansible_host": "192.0.2.1", "shardstack_hardware": {"nvidia_gpu_functions": [1, 2, 3, 4]}},
                "t2": {"shardstack_hardware": {"nvidia_gpu_functions": [1, 2]}},
                "t3": {"ansible_host": "192.0.2.3", "shardstack_hardware": {"nvidia_gpu_functions": []}}}
    play = {"ansible_play_hosts_all": ["t1", "t2"], "hostvars": hostvars}
    assert int(_value(given["training_runtime_slurm_nodes"], **play)) == 2
    assert int(_value(given["training_runtime_slurm_nodes"], train_job_nodes=1, **play)) == 1
    assert int(_value(given["training_runtime_slurm_gpus_per_node"], **play)) == 2  # the node with the fewest
    assert _value(given["training_runtime_slurm_exclude"], train_job_exclude=["t3", "t2"], **play) == \
        ["t3", "t2", "192.0.2.3"]
    assert _value(given["training_runtime_slurm_account"], train_job_account="research", **play) == "research"


def test_slurm_jobs_are_the_training_users(tmp_path: Path) -> None:
    """squeue, sacct and scancel look at the training user's jobs: training_runtime_user, whose role default is
    shardstack_common's shardstack_user (a template no play resolves here)."""
    roles = Path(__file__).resolve().parents[2] / "roles"
    default = yaml.safe_load((roles / "training_runtime" / "defaults" / "main.yml").read_text())
    assert default["training_runtime_user"] == "{{ shardstack_user }}"
    inventory = _inventory(tmp_path, "slurm")
    assert Cluster.load(inventory).job_account == "shardstack"
    data = yaml.safe_load(inventory.read_text())
    data["all"]["vars"]["shardstack_user"] = "svc"
    inventory.write_text(yaml.safe_dump(data))
    assert Cluster.load(inventory).job_account == "svc"
    data["all"]["vars"]["training_runtime_user"] = "trainer"
    inventory.write_text(yaml.safe_dump(data))
    assert Cluster.load(inventory).job_account == "trainer"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every `ansible-inventory --list` of the test (the real one runs; each call is recorded)."""
    from shardstack.ops import inventory

    done: list[Path] = []
    real = inventory.read_inventory

    def counted(path: Path) -> tuple:
        done.append(path)
        return real(path)

    monkeypatch.setattr(inventory, "read_inventory", counted)
    return done


@pytest.fixture
def slurm_answers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Slurm controller's answers in turn (squeue while the job is queued or runs, then sacct), the journal's
    step lines on the train node: what a job does over a few polls, no node reached."""
    from shardstack.ops.jobs import slurm
    from shardstack.ops.runner import CommandResult

    answers = ["43|PENDING|Resources|0:00|1||shardstack|normal|N/A",
               "43|RUNNING|None|0:05|1|t1|shardstack|normal|2026-12-01T10:00:00", "",
               "43|COMPLETED|None|0:09|1|t1|shardstack|normal|2026-12-01T10:00:00"]

    def run_command(argv: list[str], inventory: Path, pattern: str, **_: object) -> dict[str, CommandResult]:
        out = answers.pop(0) if argv[0] in ("squeue", "sacct") else '{"step": 9, "loss": 2.5}'
        return {"t1": CommandResult("t1", 0, out)}

    monkeypatch.setattr(slurm, "run_command", run_command)
    return answers


def test_waiting_on_a_job_reads_the_inventory_once(tmp_path: Path, reads: list[Path],
                                                   slurm_answers: list[str]) -> None:
    """Each poll asks the scheduler and the job account (two settings) and the loop polls three times: one read."""
    seen: list[str] = []
    st = train.wait_job("j", Cluster.load(_inventory(tmp_path, "slurm")), timeout=60, poll=0,
                        on_status=lambda s: seen.append(s.state))
    assert seen == ["pending", "running", "finished"] and st.last_step == {"step": 9, "loss": 2.5}
    assert slurm_answers == [] and len(reads) == 1


def test_a_command_reads_the_inventory_once(tmp_path: Path, reads: list[Path], slurm_answers: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from shardstack.cli import main as cli_main

    assert cli_main(["train", "status", "j", "-i", str(_inventory(tmp_path, "slurm")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "pending" and len(reads) == 1
