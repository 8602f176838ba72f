"""The ansible-runner wrapper on local hosts: typed per-host results, the failed task and its message, what
set_stats published, ad-hoc commands, and the CLI's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shardstack.ops.runner import KEEP_RUNS, _private_dir, run_command, run_playbook


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"h1": {}, "h2": {}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "children": {"train_nodes": {"hosts": {"h1": {}, "h2": {}}}},
    }}))
    return inv


def test_an_unreachable_host_is_one_line_naming_why(tmp_path: Path) -> None:
    # Over Mitogen (ansible.cfg) the message quotes ssh's output under a line of its own; a run prints it, and the
    # CLI's errors join it, on one line. Ad-hoc commands run without Mitogen: the same on their side.
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {"hosts": {"gone": {"ansible_host": "127.0.0.1", "ansible_port": 1}},
                                       "vars": {"ansible_connection": "ssh"},
                                       "children": {"train_nodes": {"hosts": {"gone": {}}}}}}))
    res = run_playbook("tests/ops/playbooks/runner_sample.yml", inv, artifacts=tmp_path / "art")
    cmd = run_command(["true"], inv, "gone", artifacts=tmp_path / "adhoc")["gone"]
    for message in (res.hosts["gone"].message, cmd.message):
        assert message and "\n" not in message and "Connection refused" in message, message
    assert res.hosts["gone"].unreachable and cmd.unreachable


def test_run_playbook_reports_per_host_results(local_inventory: Path, tmp_path: Path) -> None:
    events: list[str] = []
    res = run_playbook("tests/ops/playbooks/runner_sample.yml", local_inventory, artifacts=tmp_path / "art",
                       on_event=lambda e: events.append(e.get("event", "")))
    assert not res.success and res.rc != 0
    h1, h2 = res.hosts["h1"], res.hosts["h2"]
    assert (h1.ok, h1.changed, h1.failed) == (3, 1, 0)  # ok excludes the changed one
    assert (h2.ok, h2.changed, h2.failed) == (2, 1, 1)
    assert h2.failed_task == "Fail on the second host" and h2.message == "broken on h2"
    assert h1.success and not h2.success
    assert res.data == {"sample": {"h1": 42, "h2": 42}}
    assert "playbook_on_task_start" in events
    assert Path(res.artifact_dir).is_dir()
    assert res.to_dict()["failed"] == 1


def test_each_run_gets_a_fresh_directory_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    old = [tmp_path / f"20260101-0000{i:02d}-{i:08x}" for i in range(KEEP_RUNS + 5)]
    for d in old:
        (d / "artifacts").mkdir(parents=True)
    (tmp_path / "notes").mkdir()  # not a run directory: left alone
    new = _private_dir(tmp_path)
    assert new.is_dir() and not any(new.iterdir())
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted([d.name for d in old[-(KEEP_RUNS - 1):]] + [new.name, "notes"])


def test_check_mode_changes_nothing(local_inventory: Path, tmp_path: Path) -> None:
    res = run_playbook("tests/ops/playbooks/runner_sample.yml", local_inventory, limit="h1", check=True,
                       artifacts=tmp_path / "art")
    assert res.success and set(res.hosts) == {"h1"}


def test_run_command_per_host(local_inventory: Path, tmp_path: Path) -> None:
    res = run_command(["sh", "-c", "echo out; echo err >&2; exit 3"], local_inventory, "train_nodes", become=False,
                      artifacts=tmp_path / "adhoc")
    assert set(res) == {"h1", "h2"}
    for r in res.values():
        assert (r.rc, r.stdout, r.stderr, r.success) == (3, "out", "err", False)
    ok = run_command(["true"], local_inventory, "h1", become=False, artifacts=tmp_path / "adhoc")
    assert ok["h1"].success


def test_place_model_copies_a_directory_to_shared_storage(tmp_path: Path) -> None:
    from shardstack.ops.inventory import Cluster
    from shardstack.ops.storage import place_model

    shared = tmp_path / "shared"
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"h1": {}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "shardstack_shared_dir": str(shared)},
        "children": {"train_nodes": {"hosts": {"h1": {}}}},
    }}))
    model = tmp_path / "cache" / "stdlib-llama-0123"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "w.bin").write_bytes(b"\x00" * 10)
    dest = place_model(Cluster.load(inv), model, become=False)
    assert dest == f"{shared}/pretrained/stdlib-llama-0123"
    assert (Path(dest) / "config.json").read_text() == "{}" and (Path(dest) / "sub" / "w.bin").stat().st_size == 10
    assert (Path(dest) / "config.json").stat().st_mode & 0o777 == 0o644  # readable by the job's user


def shardstack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, timeout=120)


def test_cli_exit_codes(local_inventory: Path, tmp_path: Path) -> None:
    missing = shardstack("deploy", "-i", str(tmp_path / "nope.yml"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad_job = tmp_path / "job.yaml"
    bad_job.write_text("engine: {stage: 7}\n")
    rejected = shardstack("train", "submit", "--config", str(bad_job), "-i", str(local_inventory))
    assert rejected.returncode == 2 and "stage" in rejected.stderr and "Traceback" not in rejected.stderr
    bad_name = shardstack("train", "status", "Bad Name", "-i", str(local_inventory))
    assert bad_name.returncode == 2 and "not valid" in bad_name.stderr
    no_model = shardstack("serve")
    assert no_model.returncode == 2 and "--model" in no_model.stderr


def test_cli_registers_ops_actions_beside_the_runtime_ones() -> None:
    train = shardstack("train", "--help").stdout
    for action in ("run", "submit", "status", "stop", "logs"):
        assert action in train
    assert "rollout" in shardstack("serve", "--help").stdout
    top = shardstack("--help").stdout
    for cmd in ("deploy", "check", "validate", "wheelhouse", "demo"):
        assert cmd in top
