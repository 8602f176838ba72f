"""Project wiring that users rely on without noticing: CLI behaviour, group_vars visibility, the CI entry point."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, cwd=ROOT)


def test_root_group_vars_are_seen_by_imported_playbooks() -> None:
    # Plays imported from playbooks/ take playbooks/ as their base dir; the link makes group_vars/ visible there.
    link = ROOT / "playbooks" / "group_vars"
    assert link.is_symlink() and link.resolve() == (ROOT / "group_vars").resolve()


def test_ci_runs_make_test() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "make test" in script


def test_readme_starts_with_the_two_commands() -> None:
    lines = [x.strip() for x in (ROOT / "README.md").read_text().splitlines() if x.strip()]
    assert lines[1:3] == ["make demo", "make test"]


def test_unknown_command_is_a_usage_error_without_traceback() -> None:
    proc = run_cli("no-such-command")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_commands_without_importing_them() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0 and "lab" in proc.stdout and "deploy" in proc.stdout


def test_deploy_with_missing_inventory_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_cli("deploy", "-i", str(tmp_path / "nope.yml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_molecule_runs_tasks_the_way_ansible_cfg_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Molecule writes its own ansible.cfg; every scenario must still run modules as site.yml does (pipelined, facts
    # only under ansible_facts), or a role could pass molecule and fail the project's settings, and run ~25 % slower.
    from molecule import config

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "ansible.cfg")
    monkeypatch.setenv("MOLECULE_PROJECT_DIRECTORY", str(ROOT))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # molecule runs ansible-config
    scenarios = sorted(p.parent.name for p in (ROOT / "molecule").glob("*/molecule.yml"))
    assert "default" in scenarios
    for name in scenarios:
        scenario = config.Config(str(ROOT / "molecule" / name / "molecule.yml"),
                                 args={"base_config": [str(ROOT / ".config/molecule/config.yml")]})
        options = scenario.provisioner.config_options
        for section, key in [("defaults", "inject_facts_as_vars"), ("defaults", "strategy"), ("defaults", "timeout"),
                             ("ssh_connection", "pipelining"),
                             ("ssh_connection", "ssh_args")]:
            got, want = str(options[section][key]), cfg.get(section, key)
            assert got.lower() == want.lower(), (name, section, key, got, want)


@pytest.mark.parametrize(("configured", "runs"), [(None, "mitogen_linear"), ("linear", "linear"),
                                                  ("free", "ansible.builtin.linear"),
                                                  ("host_pinned", "ansible.builtin.linear")])
def test_the_storage_play_runs_linear_over_the_configured_strategy_where_it_is_linear(
    configured: str | None, runs: str
) -> None:
    # The NFS server must export before any client mounts; a plain-linear pin would drop Mitogen for the play.
    expr = yaml.safe_load((ROOT / "playbooks" / "storage.yml").read_text())[0]["strategy"]
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "ANSIBLE_FORCE_COLOR": "0",
           "ANSIBLE_NOCOLOR": "1"}
    env.pop("ANSIBLE_STRATEGY", None)
    if configured:
        env["ANSIBLE_STRATEGY"] = configured
    proc = subprocess.run(["ansible", "localhost", "-c", "local", "-i", "localhost,", "-m", "ansible.builtin.debug",
                           "-a", f"msg=strategy={expr.strip()}"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert f"msg: strategy={runs}\n" in proc.stdout, proc.stdout + proc.stderr
