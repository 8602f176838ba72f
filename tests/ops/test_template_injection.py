"""No user string is ever a template: every value the CLI hands Ansible (extra variables, job configs, module
options, command arguments) arrives literally, with real ansible runs on local hosts. Each payload would run
`touch <marker>` on the controller if Ansible rendered it; the marker must never appear and the payload must
arrive as sent. The control test shows the same payload does fire when passed the plain way, so these tests fail
without shardstack.ops.runner's `inert`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardstack.cli import build_parser
from shardstack.cli import main as cli_main
from shardstack.cli.deploy import run_and_report
from shardstack.errors import ShardstackError
from shardstack.ops import cordon, runner
from shardstack.ops import train as train_ops
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import run_command, run_module, run_playbook, state_dir

SINK = "tests/ops/playbooks/template_injection.yml"


def _pipe(marker: Path) -> str:
    return f"{{{{ lookup('pipe', 'touch {marker}') }}}}"


def _statement(marker: Path) -> str:
    return f"{{% for i in range(2) %}}{_pipe(marker)}{{% endfor %}}{{# a comment #}}"


def _inventory(tmp_path: Path, **extra: Any) -> Path:
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"h1": {}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **extra},
        "children": {"train_nodes": {"hosts": {"h1": {}}}, "monitoring_server": {"hosts": {"h1": {}}}},
    }}))
    return inv


@pytest.fixture
def markers(tmp_path: Path) -> Iterator[list[Path]]:
    """Files a rendered payload would create; checked (and must be absent) after each test."""
    made: list[Path] = []
    yield made
    assert not [m for m in made if m.exists()], "a user string was rendered as a template"


def test_command_arguments_reach_the_host_literally(tmp_path: Path, markers: list[Path]) -> None:
    markers += [tmp_path / "m1", tmp_path / "m2"]
    argv = ["echo", "{{ 7*7 }}", _pipe(markers[0]), _statement(markers[1])]
    res = run_command(argv, _inventory(tmp_path), "h1", become=False, artifacts=tmp_path / "adhoc")
    assert res["h1"].success, res["h1"]
    assert res["h1"].stdout == " ".join(argv[1:])


def test_module_options_reach_the_module_literally(tmp_path: Path, markers: list[Path]) -> None:
    markers += [tmp_path / "m1", tmp_path / "m2"]
    content = f"{_pipe(markers[0])}\n{_statement(markers[1])}\n"
    dest = tmp_path / "{{ 7*7 }}"  # a path holding a marker is a path, not an expression
    res = run_module("ansible.builtin.copy", {"content": content, "dest": dest, "mode": "0600"},
                     _inventory(tmp_path), "h1", become=False, artifacts=tmp_path / "adhoc")
    assert res["h1"].success, res["h1"]
    assert dest.read_text() == content
    assert oct(dest.stat().st_mode & 0o777) == "0o600"  # "0600" stayed a string: the module read it as octal


def test_the_account_a_module_runs_as_is_a_name_or_refused(tmp_path: Path) -> None:
    # Ad-hoc mode renders --become-user like the host pattern; an account name cannot hold a marker anyway.
    for user in ("{{ 7*7 }}", "a b", "-x", ""):
        with pytest.raises(ShardstackError, match="is not an account name"):
            run_module("ansible.builtin.ping", {}, _inventory(tmp_path), "h1", become_user=user)


def test_a_job_config_reaches_the_play_literally(tmp_path: Path, markers: list[Path]) -> None:
    """The reported reproduction: a job config whose data.path holds a pipe lookup, loaded by load_job (which
    accepts any string) and used as train_submit.yml and training_runtime use it."""
    markers += [tmp_path / "m1", tmp_path / "m2", tmp_path / "m3"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"data": {"path": f"/srv/x/{_pipe(markers[0])}",
                                            "tokenizer": _statement(markers[1])}}))
    config = train_ops.load_job(job)
    sink = tmp_path / "sink"
    sink.mkdir()
    extra = {"mode": "0755", "flag": "true", "n": 3, "on": True, "none": None, "list": [_pipe(markers[2]), 1.5]}
    res = run_playbook(SINK, _inventory(tmp_path), artifacts=tmp_path / "runs", extravars={
        "train_job_name": "inj", "train_job_config": config, "sink_dir": str(sink), "sink_extra": extra})
    assert res.success, res.hosts
    arrived = res.data["sink"]
    assert arrived["config"] == config
    assert arrived["echo"] == f"{config['data']['path']} {config['data']['tokenizer']}"
    assert arrived["extra"] == extra  # types as sent: "0755" and "true" stay strings, 3 and True do not
    # The job's file as the role writes it: plain YAML (no !unsafe tags) the trainer reads back unchanged.
    assert yaml.safe_load((sink / "inj.yaml").read_text()) == config


@pytest.mark.parametrize("fmt, override", [("yaml", False), ("json", False), ("yaml", True)])
def test_extra_vars_files_and_pairs_reach_the_play_literally(fmt: str, override: bool, tmp_path: Path,
                                                             markers: list[Path],
                                                             capsys: pytest.CaptureFixture) -> None:
    """`-e @FILE` (YAML or JSON) and `-e KEY=VALUE` as the CLI parses them, run the way `deploy` runs site.yml:
    every string, however deep in the file, arrives as sent; later -e win, as in Ansible."""
    markers += [tmp_path / "m1", tmp_path / "m2", tmp_path / "m3", tmp_path / "m4"]
    sink = tmp_path / "sink"
    sink.mkdir()
    extra = {"mode": "0755", "flag": "true", "n": 3, "on": True, "none": None, "list": [_pipe(markers[2]), 1.5]}
    config = {"data": {"path": f"/srv/x/{_pipe(markers[0])}", "tokenizer": _statement(markers[1])}}
    values = {"train_job_name": "fromfile", "sink_dir": str(sink), "sink_extra": extra, "train_job_config": config}
    file = tmp_path / f"vars.{fmt}"
    file.write_text(yaml.safe_dump(values) if fmt == "yaml" else json.dumps(values))
    argv = ["deploy", "-i", str(_inventory(tmp_path)), "--json", "-e", f"@{file}", "-e", "train_job_name=later"]
    if override:
        argv += ["-e", f"sink_extra={_pipe(markers[3])}"]
    res = run_and_report(SINK, build_parser(argv).parse_args(argv), "extra vars")
    assert res.success, res.hosts
    arrived = res.data["sink"]
    assert arrived["config"] == values["train_job_config"]
    assert arrived["extra"] == (_pipe(markers[3]) if override else extra)  # types as in the file
    assert (sink / "later.yaml").is_file() and not (sink / "fromfile.yaml").exists()
    assert json.loads(capsys.readouterr().out)["success"] is True


def test_the_same_payload_passed_plainly_does_run(tmp_path: Path) -> None:
    """Control: the payload is live. Given to ansible-playbook as plain extra vars (what ansible-runner's
    extravars= does), Ansible renders it and the marker appears; the tests above would see that."""
    marker = tmp_path / "control"
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"train_job_name": "inj", "sink_dir": str(tmp_path),
                                 "train_job_config": {"data": {"path": f"/srv/x/{_pipe(marker)}"}}}))
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(_inventory(tmp_path)),
                           "-e", f"@{plain}", SINK], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert marker.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]


def test_train_submit_passes_config_and_cordoned_names_inert(tmp_path: Path, markers: list[Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """submit() through the real playbooks/train_submit.yml: a cordoned name from the state file (an inventory-side
    string) is rendered into the first play's failure message, the job config is written as the run's extra vars."""
    markers += [tmp_path / "m1", tmp_path / "m2"]
    inv = _inventory(tmp_path, shardstack_scheduler="systemd")
    cordoned = f"n9{_pipe(markers[0])}"
    monkeypatch.setattr(runner, "state_dir", lambda: tmp_path / "controller-state")
    cordon.state_file(inv).parent.mkdir(parents=True)
    cordon.state_file(inv).write_text(json.dumps({cordoned: {"roles": ["train"]}}))
    config = {"data": {"path": f"/srv/shardstack/data/{_pipe(markers[1])}"}}  # under the default shared dir
    # Two nodes asked of one: the first play fails on localhost before any node is touched, with its message.
    res = train_ops.submit(config, "inj", Cluster.load(inv), nodes=2, prepare_demo_data=True)
    assert not res.success
    assert f"({cordoned} cordoned)" in res.hosts["localhost"].message
    # What Ansible loaded as the run's extra vars, rendered the way a play renders a reference to them.
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    extravars = Path(res.artifact_dir).parents[1] / "env" / "extravars"
    loaded = DataLoader().load_from_file(str(extravars), trusted_as_template=True)
    templar = Templar(loader=DataLoader(), variables=loaded)
    assert templar.template(trust_as_template("{{ train_job_config.data.path }}")) == config["data"]["path"]
    assert templar.template(trust_as_template("{{ train_job_exclude }}")) == [cordoned]
    assert extravars.stat().st_mode & 0o077 == 0


def test_logs_grep_reaches_journalctl_literally(tmp_path: Path, markers: list[Path],
                                               capsys: pytest.CaptureFixture) -> None:
    """`shardstack logs --grep` on a collector (this machine): the pattern is journalctl's, never Ansible's."""
    markers.append(tmp_path / "m1")
    pattern = _pipe(markers[0])
    assert cli_main(["logs", "--grep", pattern, "--collector", "h1", "-i", str(_inventory(tmp_path)), "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # The command as the collector ran it, from this run's ansible-runner events (found by the unique marker path).
    ran = []
    for f in (state_dir() / "adhoc").glob("*/artifacts/*/job_events/*.json"):
        event = json.loads(f.read_text())
        if event["event"] in ("runner_on_ok", "runner_on_failed") and pattern in f.read_text():
            ran.append(event["event_data"]["res"]["cmd"])
    assert ran and all(f"--grep={pattern}" in cmd for cmd in ran)


@pytest.mark.parametrize("argv", [
    ["logs", "--collector", "{{ lookup('pipe', 'touch MARKER') }}"],
    ["logs", "--collector", "h1{% if true %}{% endif %}"],
    ["logs", "--collector", "h1{# x #}"],
])
def test_a_host_pattern_holding_a_template_is_refused(argv: list[str], tmp_path: Path, markers: list[Path],
                                                      capsys: pytest.CaptureFixture) -> None:
    """Ad-hoc mode renders its host pattern and nothing can mark it unsafe: refused, exit 2, one line."""
    markers.append(tmp_path / "MARKER")
    argv = [a.replace("MARKER", str(markers[0])) for a in argv]
    assert cli_main([*argv, "-i", str(_inventory(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "template marker" in err and "Traceback" not in err


def test_keys_that_cannot_be_marked_are_refused(tmp_path: Path) -> None:
    """JSON cannot mark a key unsafe: a nested key holding a marker, or one Ansible's decoder reserves, is refused
    before any run; a variable name must be an identifier."""
    inv = _inventory(tmp_path)
    for extravars, needle in (({"v": {"{{ 7*7 }}": 1}}, "template marker"),
                              ({"v": {"__ansible_vault": "x"}}, "reserved by Ansible"),
                              ({"not a name": 1}, "not an identifier")):
        with pytest.raises(ShardstackError, match=needle):
            run_playbook(SINK, inv, extravars=extravars, artifacts=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
