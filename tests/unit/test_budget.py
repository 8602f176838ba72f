"""`.ci/budget.py`, the table `make test` ends with: each stage's wall time and exit code, pytest's counts from its
JUnit file, molecule scenarios with their e2e counts or their verify's task recap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

BUDGET = Path(__file__).resolve().parents[2] / ".ci" / "budget.py"


def _budget(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUDGET), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def _row(table: str, stage: str) -> list[str]:
    """The row of `stage` (its first words), split on white space after the name."""
    line = next(line for line in table.splitlines() if line.startswith(stage + " "))
    return [stage, *line[len(stage):].split()]


def test_stages_pytest_counts_and_molecule_scenarios_make_one_table(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
        "@pytest.mark.skip(reason='x')\ndef test_c():\n    pass\n")
    assert _budget(tmp_path, "start").returncode == 0
    unit = _budget(tmp_path, "stage", "unit", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "test_sample.py", "--junitxml=artifacts/budget/unit.xml")
    assert unit.returncode == 0, unit.stdout + unit.stderr
    failing = _budget(tmp_path, "stage", "lint", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failing.returncode == 3  # the stage's own exit code, so make sees the failure
    molecule = tmp_path / "artifacts" / "molecule"
    molecule.mkdir(parents=True)
    (molecule / "journal.result").write_text("passed 383\n")
    # As molecule writes it: colours, a "│" margin, recap rows wrapped; converge's recap is not the verify's.
    (molecule / "journal.log").write_text(
        "INFO     journal \u279c converge: Executing\n  \u2502 PLAY RECAP\n"
        "  \u2502 node1 : ok=40   changed=9    unreachable=0    failed=0\n  \u2502   skipped=3    rescued=0\n"
        "INFO     journal \u279c verify: Executing\n  \x1b[2m\u2502\x1b[0m PLAY RECAP\n"
        "  \x1b[2m\x1b[33m\u2502\x1b[0m \x1b[33mnode1                      : ok=12   changed=1    unreachable=0    "
        "failed=0\x1b[0m\n  \x1b[2m\x1b[33m\u2502\x1b[0m \x1b[33m  skipped=2    rescued=0    ignored=0\x1b[0m\n"
        "  \u2502 node2                      : ok=10   changed=0    unreachable=0    failed=1\n"
        "  \u2502   skipped=0    rescued=0    ignored=0\n  \u2514\u2500 Return code: 2\n"
        "INFO     journal \u279c verify: Executed: Failed\nINFO     journal \u279c destroy: Executing\n"
        "  \u2502 PLAY RECAP\n  \u2502 localhost : ok=3    changed=2    unreachable=0    failed=0\n"
        "  \u2502   skipped=0    rescued=0\n")
    (molecule / "journal.failed").touch()
    (molecule / "slurm.result").write_text("FAILED 946\n")
    e2e = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py",
                          "--junitxml=artifacts/molecule/slurm.e2e.xml"], cwd=tmp_path, capture_output=True)
    assert e2e.returncode == 0

    out = _budget(tmp_path, "table")
    assert out.returncode == 0, out.stderr
    table = out.stdout
    assert _row(table, "stage")[:5] == ["stage", "seconds", "passed", "skipped", "failed"]
    assert _row(table, "unit")[2:6] == ["2", "1", "0", "ok"]
    assert _row(table, "lint")[2:] == ["-", "-", "-", "FAILED", "(rc", "3)"]
    # Longest scenario first; the e2e's JUnit counts where there is one, else the last recap's tasks.
    assert _row(table, "molecule slurm")[1:7] == ["946", "2", "1", "0", "FAILED", "(e2e"]
    assert _row(table, "molecule journal")[1:7] == ["383", "22", "2", "1", "ok", "(verify"]
    assert table.index("slurm") < table.index("journal")
    assert _row(table, "total (wall)")[1].isdigit()
    # A new run starts from an empty table: the old stages and scenario results are gone.
    assert _budget(tmp_path, "start").returncode == 0
    assert _budget(tmp_path, "table").stdout.splitlines()[1:] == [_budget(tmp_path, "table").stdout.splitlines()[-1]]


def test_the_table_ends_with_each_failed_test_and_its_message(tmp_path: Path) -> None:
    (tmp_path / "test_e2e.py").write_text(
        "def test_ok():\n    pass\n\n"
        "def test_wait():\n    raise AssertionError('timed out\\n' + '\\n'.join(f'node {i}' for i in range(70)))\n\n"
        "def test_flood():\n    assert 0.3 <= 0.1, 'flooded p99 ms'\n")
    assert _budget(tmp_path, "start").returncode == 0
    (tmp_path / "artifacts" / "molecule").mkdir(parents=True)
    (tmp_path / "artifacts" / "molecule" / "default.result").write_text("FAILED 900\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_e2e.py",
                    "--junitxml=artifacts/molecule/default.e2e.xml"], cwd=tmp_path, capture_output=True, check=False)
    table = _budget(tmp_path, "table").stdout
    failed = [line for line in table.splitlines() if line.startswith("FAILED")]
    assert failed == ["FAILED default.e2e: test_wait: AssertionError: timed out",
                      "FAILED default.e2e: test_flood: AssertionError: flooded p99 ms"], table
    assert _row(table, "molecule default")[1:6] == ["900", "1", "0", "2", "FAILED"]
    # The first failure's other lines come last, as many as pytest's message keeps.
    rest = table.split("flooded p99 ms\n", 1)[1].splitlines()
    assert rest[:60] == [f"  node {i}" for i in range(60)] and "10 more lines" in rest[60] and len(rest) == 61, table
    # The next run starts without the last one's failures.
    assert _budget(tmp_path, "start").returncode == 0
    assert "FAILED" not in _budget(tmp_path, "table").stdout


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    out = _budget(tmp_path, "stage", "x")
    assert out.returncode == 2 and "usage" in out.stderr


def test_the_table_names_each_host_a_verify_failed_on_with_its_task_and_message(tmp_path: Path) -> None:
    """A real ansible-playbook run, laid out as molecule logs it (margin, lines wrapped at 80 columns): the failure
    a block rescued and the one ignore_errors passed are not the host's failure; the unrescued one is."""
    (tmp_path / "hosts.yml").write_text(
        "all:\n  hosts:\n    node1: {}\n    node2: {}\n  vars: {ansible_connection: local, "
        f"ansible_python_interpreter: {sys.executable}}}\n")
    (tmp_path / "verify.yml").write_text("""
- name: Verify
  hosts: all
  gather_facts: false
  tasks:
    - name: A guard that is meant to refuse, rescued
      block:
        - name: Refuse
          ansible.builtin.fail: {msg: refused as meant}
      rescue:
        - name: Rescued
          ansible.builtin.debug: {msg: ok}
    - name: A failure that is ignored
      ansible.builtin.fail: {msg: ignored}
      ignore_errors: true
    - name: "Verify - a line logged on each sender reaches the central store within 10 s, and it is found from the
        controller"
      ansible.builtin.assert:
        that: inventory_hostname != 'node2'
        fail_msg: "arrived after 14.2 s on node2 \\u2014 \\"slow\\""
    - name: After
      ansible.builtin.debug: {msg: ok}
""")
    run = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "hosts.yml", "verify.yml"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "HOME": str(tmp_path),
                              "ANSIBLE_NOCOLOR": "1", "LANG": "C.UTF-8"})
    assert run.returncode == 2, run.stdout + run.stderr
    wrapped = "\n".join(f"  \u2502 {part}" for line in (run.stderr + run.stdout).splitlines()
                        for part in (textwrap.wrap(line, 78, subsequent_indent="  ") or [""]))
    assert _budget(tmp_path, "start").returncode == 0
    molecule = tmp_path / "artifacts" / "molecule"
    molecule.mkdir(parents=True)
    (molecule / "default.result").write_text("FAILED 900\n")
    (molecule / "default.log").write_text("INFO     default \u279c verify: Executing\n" + wrapped
                                          + "\nINFO     default \u279c verify: Executed: Failed\n")
    table = _budget(tmp_path, "table").stdout
    assert _row(table, "molecule default")[5] == "FAILED"
    assert [line for line in table.splitlines() if line.startswith("FAILED")] == [
        "FAILED molecule default verify: [node2] Verify - a line logged on each sender reaches the central store "
        "within 10 s, and it is found from the controller: arrived after 14.2 s on node2 \u2014 \"slow\""], table
