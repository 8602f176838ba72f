"""`shardstack node cordon|drain|uncordon`: the state file in the controller's state directory, the HAProxy
runtime-API commands, and train_submit.yml leaving cordoned train nodes out (ansible-playbook --list-hosts and the
real assert)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops import cordon, runner
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import CommandResult

REPO = Path(__file__).resolve().parents[2]
GROUPS = {"train_nodes": ["t1", "t2", "t3"], "inference_nodes": ["i1", "both"], "loadbalancer": []}


@pytest.fixture(autouse=True)
def commands(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], str]]:
    """The ad-hoc commands apply() would run (argv, host pattern), each answered with success and no output."""
    sent: list[tuple[list[str], str]] = []

    def fake(argv: list[str], inventory: Path, pattern: str, **kwargs: object) -> dict[str, CommandResult]:
        sent.append((argv, pattern))
        return {h: CommandResult(h, 0) for h in pattern.split(",")}

    monkeypatch.setattr(cordon, "run_command", fake)
    return sent


@pytest.fixture(autouse=True)
def controller_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The controller's state directory (shardstack.ops.runner.state_dir) of this test."""
    monkeypatch.setattr(runner, "state_dir", lambda: tmp_path / "controller-state")
    return tmp_path / "controller-state"


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory" / "hosts.ini"
    path.parent.mkdir()
    path.write_text("[train_nodes]\nt1\nt2\nt3\nboth\n[inference_nodes]\ni1\nboth\n[loadbalancer]\n")
    return path


def test_state_lives_in_the_controller_state_dir_keyed_by_the_inventory(inventory: Path, controller_state: Path,
                                                                       tmp_path: Path) -> None:
    """Never in the inventory's directory (Ansible would parse a file there as inventory): one file per inventory
    under the controller's state directory, the same however the inventory's path is spelled."""
    path = cordon.state_file(inventory)
    assert path.parent == controller_state / "cordon" and path.name.startswith("inventory-hosts.ini-")
    assert cordon.state_file(tmp_path / "." / "inventory" / ".." / "inventory" / "hosts.ini") == path
    assert cordon.state_file(inventory.parent) != path  # another inventory (the directory), another file
    assert cordon.load(Cluster(inventory)) == {} and cordon.cordoned(Cluster(inventory)) == []
    cordon.apply("t1", "cordon", Cluster(inventory, GROUPS))
    assert path.is_file() and sorted(p.name for p in inventory.parent.iterdir()) == ["hosts.ini"]


def test_a_state_file_beside_the_inventory_is_moved_out(inventory: Path) -> None:
    """Earlier versions wrote `<inventory dir>/state/cordoned.json`: still read, and gone after the next change."""
    legacy = inventory.parent / "state" / "cordoned.json"
    legacy.parent.mkdir()
    legacy.write_text(json.dumps({"t2": {"action": "drain", "roles": ["train"], "since": "2026-01-01T00:00:00Z"}}))
    assert cordon.cordoned(Cluster(inventory)) == ["t2"]
    cordon.apply("t1", "cordon", Cluster(inventory, GROUPS))
    assert cordon.cordoned(Cluster(inventory)) == ["t1", "t2"]
    assert sorted(p.name for p in inventory.parent.iterdir()) == ["hosts.ini"]


def test_node_cordon_writes_nothing_into_the_inventory_directory(tmp_path: Path, controller_state: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """`shardstack node cordon -i inventory/prod` (a directory inventory, as a real cluster's): the directory holds
    what it held before; the state is in the controller's state directory."""
    from shardstack.cli import main as cli_main

    prod = tmp_path / "inventory" / "prod"
    (prod / "group_vars").mkdir(parents=True)
    (prod / "hosts.yml").write_text("all:\n  children:\n    train_nodes:\n      hosts:\n        t1:\n")
    (prod / "group_vars" / "all.yml").write_text("shardstack_scheduler: systemd\n")
    before = sorted(p.relative_to(prod) for p in prod.rglob("*"))
    assert cli_main(["node", "cordon", "t1", "-i", str(prod), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(p.relative_to(prod) for p in prod.rglob("*")) == before
    assert Path(out["state_file"]) == cordon.state_file(prod) and out["state_file"].startswith(str(controller_state))
    assert cordon.cordoned(Cluster(prod)) == ["t1"]


def test_cordon_drain_uncordon_a_train_node(inventory: Path) -> None:
    out = cordon.apply("t2", "cordon", Cluster(inventory, GROUPS))
    assert out.roles == ["train"] and out.load_balancers == []
    state = json.loads(cordon.state_file(inventory).read_text())
    assert list(state) == ["t2"] and state["t2"]["action"] == "cordon" and state["t2"]["roles"] == ["train"]
    assert state["t2"]["since"].endswith("Z")

    out = cordon.apply("t3", "drain", Cluster(inventory, GROUPS))
    assert out.stopped_jobs == [] and "no training job was running on it" in out.notes
    assert cordon.cordoned(Cluster(inventory), "train") == ["t2", "t3"]
    assert cordon.cordoned(Cluster(inventory), "inference") == []

    cordon.apply("t2", "uncordon", Cluster(inventory, GROUPS))
    assert cordon.cordoned(Cluster(inventory)) == ["t3"]
    assert not [p for p in cordon.state_file(inventory).parent.iterdir() if p.name.startswith(".")]


def test_drain_stops_the_jobs_running_on_a_train_node(inventory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """drain signals the workers of each running job on the node (SIGUSR1: stop at a checkpoint, exit 0); the
    units it signalled name the jobs. A node that cannot be reached is drained all the same, with a note."""
    sent: list[list[str]] = []

    def answer(argv: list[str], inventory: Path, pattern: str, **kwargs: object) -> dict[str, CommandResult]:
        sent.append(argv)
        out = "shardstack-train@run1.service\nshardstack-train@nightly-7.service\n" if "pkill" in argv[-1] else ""
        return {pattern: CommandResult(pattern, 0, stdout=out)}

    monkeypatch.setattr(cordon, "run_command", answer)
    out = cordon.apply("t1", "drain", Cluster(inventory, GROUPS))
    assert sent[0] == ["sh", "-c", cordon.STOP_JOBS]
    assert out.stopped_jobs == ["run1", "nightly-7"]
    assert sum("resumes it without this node" in n for n in out.notes) == 2
    assert cordon.cordoned(Cluster(inventory), "train") == ["t1"]

    monkeypatch.setattr(cordon, "run_command", lambda argv, inv, pattern, **kw: {
        pattern: CommandResult(pattern, 1, unreachable=True, message="ssh: connection timed out")})
    out = cordon.apply("t2", "drain", Cluster(inventory, GROUPS))
    assert out.stopped_jobs == [] and cordon.cordoned(Cluster(inventory), "train") == ["t1", "t2"]
    assert any("not signalled (ssh: connection timed out)" in n for n in out.notes)


def test_stop_jobs_script_signals_only_the_agents_children(tmp_path: Path) -> None:
    """STOP_JOBS with systemctl answered by a stand-in on PATH: the agent's child gets SIGUSR1, the agent does not."""
    child_file = tmp_path / "child.out"
    # The child says "ready" (in its file) once its handler is in place: a signal before that would kill it.
    agent = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(9))\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time\\n"
        "signal.signal(signal.SIGUSR1, lambda *a: (open(sys.argv[1], \"w\").write(\"USR1\"), sys.exit(0)))\\n"
        f"open(sys.argv[1], \"w\").write(\"ready\")\\ntime.sleep(60)', '{child_file}'])\n"
        f"while not (os.path.exists('{child_file}') and open('{child_file}').read() == 'ready'): time.sleep(0.05)\n"
        "print('ready', flush=True)\nc.wait()\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
        fake = tmp_path / "bin" / "systemctl"
        fake.parent.mkdir()
        fake.write_text("#!/bin/sh\ncase \"$1\" in\n  list-units) echo 'shardstack-train@run1.service loaded active "
                        f"running x';;\n  show) echo {agent.pid};;\nesac\n")
        fake.chmod(0o755)
        env = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
        res = subprocess.run(["sh", "-c", cordon.STOP_JOBS], env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and res.stdout.split() == ["shardstack-train@run1.service"], res
        for _ in range(100):
            if child_file.exists() and child_file.read_text() == "USR1":
                break
            time.sleep(0.1)
        assert child_file.read_text() == "USR1"
        assert agent.poll() is None  # the agent itself was not signalled
    finally:
        agent.kill()
        agent.wait()


def test_inference_node_without_load_balancers_is_recorded_with_a_note(inventory: Path) -> None:
    groups = {**GROUPS, "train_nodes": [*GROUPS["train_nodes"], "both"]}
    out = cordon.apply("both", "cordon", Cluster(inventory, groups))
    assert out.roles == ["inference", "train"]
    assert any("no loadbalancer hosts" in n for n in out.notes)
    assert cordon.cordoned(Cluster(inventory), "inference") == ["both"] == cordon.cordoned(Cluster(inventory), "train")


def test_errors_are_shardstack_errors_with_hints(inventory: Path) -> None:
    with pytest.raises(ShardstackError, match="neither an inference node nor a train node") as exc:
        cordon.apply("nope", "cordon", Cluster(inventory, GROUPS))
    assert exc.value.hint and "t1" in exc.value.hint
    with pytest.raises(ShardstackError, match="unknown action"):
        cordon.apply("t1", "evict", Cluster(inventory, GROUPS))
    cordon.state_file(inventory).parent.mkdir(parents=True)
    cordon.state_file(inventory).write_text("{not json")
    with pytest.raises(ShardstackError, match="cannot read the cordon state") as exc:
        cordon.cordoned(Cluster(inventory))
    assert exc.value.hint
    cordon.state_file(inventory).write_text('["t1"]')
    with pytest.raises(ShardstackError, match="not a mapping"):
        cordon.load(Cluster(inventory))


def test_the_node_carries_a_cordoned_metric(inventory: Path, commands: list, tmp_path: Path) -> None:
    """cordon/drain write shardstack_node_cordoned 1 into node_exporter's textfile directory on the node, uncordon 0;
    the script really produces the file (run here with sh) and node_exporter's format parses."""
    from prometheus_client.parser import text_string_to_metric_families

    out = cordon.apply("t1", "cordon", Cluster(inventory, GROUPS), textfile_dir=str(tmp_path / "textfile"))
    assert out.metric_written and commands[-1][1] == "t1"
    (tmp_path / "textfile").mkdir()
    for action, value in (("drain", 1.0), ("uncordon", 0.0), ("cordon", 1.0)):
        argv = cordon.metric_argv(action, str(tmp_path / "textfile"))
        subprocess.run(argv, check=True)
        files = sorted(p.name for p in (tmp_path / "textfile").iterdir())
        assert files == [cordon.METRIC_FILE]  # no temporary file left behind
        text = (tmp_path / "textfile" / cordon.METRIC_FILE).read_text()
        [family] = text_string_to_metric_families(text)
        assert family.name == "shardstack_node_cordoned" and family.type == "gauge"
        assert [s.value for s in family.samples] == [value]


def test_an_unreachable_node_is_still_cordoned_with_a_note(inventory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(argv: list[str], inventory: Path, pattern: str, **kwargs: object) -> dict[str, CommandResult]:
        return {pattern: CommandResult(pattern, 4, unreachable=True, message="ssh: connect timed out")}

    monkeypatch.setattr(cordon, "run_command", unreachable)
    out = cordon.apply("t1", "cordon", Cluster(inventory, GROUPS))
    assert not out.metric_written and cordon.cordoned(Cluster(inventory)) == ["t1"]
    assert any("shardstack_node_cordoned not written on t1 (ssh: connect timed out)" in n for n in out.notes)


def test_haproxy_commands() -> None:
    assert cordon.haproxy_command("inference", "n2", "cordon") == "set server inference/n2 state drain"
    assert cordon.haproxy_command("inference", "n2", "drain") == "set server inference/n2 state drain"
    assert cordon.haproxy_command("inference", "n2", "uncordon") == "set server inference/n2 state ready"
    for name in ("n2; shutdown sessions", "n2\nshow stat", ""):
        with pytest.raises(ShardstackError, match="not a HAProxy name"):
            cordon.haproxy_command("inference", name, "cordon")
    argv = cordon.socket_argv("set server inference/n2 state drain", "/run/haproxy/admin.sock")
    assert argv[:2] == ["sh", "-c"]
    assert shlex.split(argv[2]) == ["printf", "%s\\n", "set server inference/n2 state drain", "|", "socat", "stdio",
                                    "/run/haproxy/admin.sock"]
    # The shell part really prints the one line socat would send.
    printed = subprocess.run(["sh", "-c", argv[2].split(" | ")[0]], capture_output=True, text=True, check=True)
    assert printed.stdout == "set server inference/n2 state drain\n"


def test_haproxy_answers() -> None:
    cmd = "set server inference/n2 state drain"
    cordon.check_haproxy_answers({"lb": CommandResult("lb", 0, "\n")}, ["lb"], cmd)
    cases = [({"lb": CommandResult("lb", 0, "No such server.\n")}, "No such server"),
             ({"lb": CommandResult("lb", -1, unreachable=True, message="ssh: timeout")}, "ssh: timeout"),
             ({}, "no answer")]
    for answers, text in cases:
        with pytest.raises(ShardstackError, match=text) as exc:
            cordon.check_haproxy_answers(answers, ["lb"], cmd)
        assert exc.value.exit_code == 1  # a host failed; 2 is for bad input


def test_a_haproxy_refusal_exits_1_and_changes_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """`shardstack node cordon` when HAProxy answers `No such server.`: one line, exit 1 (an operational failure,
    as documented), not 2 (usage error); the state is not written."""
    from shardstack.cli import main as cli_main

    def refuse(argv: list[str], inventory: Path, pattern: str, **kwargs: object) -> dict[str, CommandResult]:
        return {h: CommandResult(h, 0, "No such server.\n") for h in pattern.split(",")}

    monkeypatch.setattr(cordon, "run_command", refuse)
    inv = tmp_path / "inventory" / "hosts.ini"
    inv.parent.mkdir()
    inv.write_text("[inference_nodes]\ni1\n[loadbalancer]\nlb\n")
    assert cli_main(["node", "cordon", "i1", "-i", str(inv)]) == 1
    err = capsys.readouterr().err
    assert "HAProxy refused `set server inference/i1 state drain`: lb: No such server." in err
    assert "Traceback" not in err and not cordon.state_file(inv).exists()
    assert cli_main(["node", "cordon", "nope", "-i", str(inv)]) == 2  # bad input stays a usage error


def _playbook(inventory: Path, extra: dict, *more: str) -> subprocess.CompletedProcess[str]:
    extra = {"train_job_name": "j", "train_job_config": {}, **extra}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
            str(REPO / "playbooks" / "train_submit.yml"), "-e", json.dumps(extra), *more]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


@pytest.mark.parametrize(("extra", "hosts"), [
    ({}, "t1,t2,t3,both"),
    ({"train_job_nodes": 2}, "t1,t2"),
    ({"train_job_exclude": ["t1"], "train_job_nodes": 2}, "t2,t3"),
    ({"train_job_exclude": ["t2", "both"]}, "t1,t3"),
])
def test_train_submit_leaves_cordoned_nodes_out(inventory: Path, extra: dict, hosts: str) -> None:
    # Only the first play (localhost, named in the inventory so --limit can pick it), which chooses the nodes.
    inventory.write_text(inventory.read_text() + "[controller]\nlocalhost ansible_connection=local\n")
    proc = _playbook(inventory, extra, "--limit", "localhost")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"nodes of the job (systemd): {hosts}" in proc.stdout


def test_train_submit_refuses_when_too_few_nodes_remain(inventory: Path) -> None:
    # Only the first play (localhost, named in the inventory so --limit can pick it) runs: nothing is deployed.
    inventory.write_text(inventory.read_text() + "[controller]\nlocalhost ansible_connection=local\n")
    proc = _playbook(inventory, {"train_job_exclude": ["t1", "t2"], "train_job_nodes": 3}, "--limit", "localhost")
    assert proc.returncode != 0
    assert "2 train node(s) usable (t1, t2 cordoned), 3 needed" in proc.stdout
    proc = _playbook(inventory, {"train_job_exclude": ["t1"], "train_job_nodes": 3}, "--limit", "localhost")
    assert proc.returncode == 0, proc.stdout + proc.stderr
