"""Project wiring that users rely on without noticing: CLI behaviour, group_vars visibility, the CI entry point."""

import subprocess
import sys
from pathlib import Path

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
