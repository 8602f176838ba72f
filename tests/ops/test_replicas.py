"""ops.replicas: which replica jobs to submit or cancel, squeue's lines, the job's command line, and the script that
holds a node while its unit runs (run by sh against a systemctl that answers the states a unit goes through; the
real unit under Slurm is the slurm lab's)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops.replicas import LocalSlurm, ReplicaSettings, hold_script, parse, plan, sbatch_argv

SQUEUE = """\
31|RUNNING|node3|2026-12-05T01:00:00
34|PENDING||2026-12-05T01:05:00
33|RUNNING|node2|2026-12-05T01:04:00
35|PENDING|(null)|2026-12-05T01:06:00
not a job line
"""


def test_squeue_lines_become_jobs_oldest_first() -> None:
    jobs = parse(SQUEUE)
    assert [(j.job_id, j.state, j.node, j.pending) for j in jobs] == [
        (31, "RUNNING", "node3", False), (33, "RUNNING", "node2", False), (34, "PENDING", "", True),
        (35, "PENDING", "", True)]
    assert parse("") == []


def test_scaling_in_cancels_pending_jobs_first_then_the_newest_running() -> None:
    jobs = parse(SQUEUE)
    assert plan(jobs, 4) == (0, [])
    assert plan(jobs, 6) == (2, [])
    assert plan(jobs, 3) == (0, [35])
    assert plan(jobs, 1) == (0, [35, 34, 33])
    assert plan(jobs, 0) == (0, [35, 34, 33, 31])
    assert plan([], 2) == (2, [])
    with pytest.raises(ShardstackError, match="0 or more"):
        plan(jobs, -1)


def test_a_replica_job_asks_for_one_whole_inference_node_in_the_inference_qos() -> None:
    argv = sbatch_argv(ReplicaSettings())
    assert argv[:2] == ["sbatch", "--parsable"]
    assert {"--account=inference", "--qos=inference", "--nodes=1", "--exclusive", "--constraint=inference",
            "--job-name=shardstack-replica", "--parsable"} <= set(argv)
    script = next(a for a in argv if a.startswith("--wrap=")).removeprefix("--wrap=")
    assert subprocess.run(["sh", "-n", "-c", script], timeout=10).returncode == 0
    other = sbatch_argv(ReplicaSettings(account="serving", qos="urgent"))
    assert {"--account=serving", "--qos=urgent"} <= set(other)
    with pytest.raises(ShardstackError, match="replica qos 'a b' is not a Slurm name"):
        ReplicaSettings(qos="a b")


def test_the_autoscalers_unit_submits_as_the_job_account_and_queries_as_itself() -> None:
    slurm = LocalSlurm(job_user="nobody")  # make test runs as root, as the unit does
    assert slurm.submit(["id", "-un"]).strip() == "nobody"  # root's unit: sbatch drops to the job account
    assert slurm.query(["id", "-un"]).strip() == "root"  # squeue and scancel as root (Slurm's admin)
    assert LocalSlurm().submit(["id", "-un"]).strip() == "root"
    with pytest.raises(ShardstackError, match=r"^sh failed \(exit 3\): why$"):
        slurm.query(["sh", "-c", "echo why >&2; exit 3"])
    with pytest.raises(ShardstackError, match=r"^squeue-not-here: "):
        slurm.query(["squeue-not-here"])


def _hold(tmp_path: Path, states: list[str], wait: float) -> tuple[int | None, int]:
    """Run the hold script against a systemctl that answers `states` one per call (the last one from then on);
    its exit code (None: still holding after `wait` seconds) and how many times it asked."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "states").write_text("\n".join(states) + "\n")
    (bindir / "systemctl").write_text(
        "#!/bin/sh\n"
        'n=$(cat "$CALLS" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$CALLS"\n'
        'total=$(wc -l < "$STATES"); [ $n -gt $total ] && n=$total\n'
        'sed -n "${n}p" "$STATES"\n')
    (bindir / "systemctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "STATES": str(tmp_path / "states"),
           "CALLS": str(tmp_path / "calls")}
    proc = subprocess.Popen(["sh", "-c", hold_script(interval=0.05, start_polls=5)], env=env)
    try:
        code = proc.wait(wait)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        proc.kill()
        proc.wait()
    return code, int((tmp_path / "calls").read_text())


def test_the_job_holds_its_node_while_the_unit_starts_serves_or_restarts(tmp_path: Path) -> None:
    code, calls = _hold(tmp_path, ["inactive", "activating", "active", "deactivating", "activating", "active"], 3)
    assert code is None and calls > 20


def test_the_job_ends_when_its_unit_has_stopped_or_failed(tmp_path: Path) -> None:
    code, calls = _hold(tmp_path, ["activating", "active", "active", "failed"], 30)
    assert (code, calls) == (1, 4)


def test_the_job_ends_when_its_unit_never_started(tmp_path: Path) -> None:
    code, calls = _hold(tmp_path, ["inactive"], 30)
    assert (code, calls) == (1, 6)  # start_polls=5 polls of grace, then the sixth says it never started
