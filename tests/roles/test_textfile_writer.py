"""The one node-metrics writer (roles/shardstack_common/files/shardstack_textfile.py) every metrics script on a node
uses, and its install beside a script (tasks/textfile_writer.yml) run for real here: a script laid out as a role
lays it out imports it with no help from PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import shardstack_textfile as textfile
import yaml
from shardstack.ops.runner import run_playbook

REPO = Path(__file__).resolve().parents[2]
PATROL = REPO / "roles" / "dcgm_exporter" / "files" / "shardstack_gpu_health.py"
FIXTURES = REPO / "tests" / "monitoring" / "fixtures" / "gpu_health"


def test_write_replaces_the_file_whole_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "x.prom"
    target.write_text("old 1\n")
    assert textfile.write(target, "x 2\n") == target
    assert target.read_text() == "x 2\n" and target.stat().st_mode & 0o777 == 0o644
    textfile.write(target, "{}", 0o600)
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["x.prom"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "x.prom"
    target.write_text("old 1\n")
    with pytest.raises(UnicodeEncodeError):
        textfile.write(target, "bad \udcff\n")  # a lone surrogate cannot be encoded: the write fails midway
    assert target.read_text() == "old 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.prom"]


def test_escape_follows_the_exposition_format() -> None:
    assert textfile.escape('a\\b"c\nd') == 'a\\\\b\\"c\\nd'


@pytest.mark.skipif(os.geteuid() != 0, reason="the task file installs root-owned files")
def test_a_script_beside_the_installed_writer_runs_without_pythonpath(tmp_path: Path) -> None:
    libexec, out = tmp_path / "libexec", tmp_path / "textfile"
    out.mkdir()
    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {}}, "vars": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    extravars = {"__shardstack_common_textfile_script_dir": str(libexec)}
    first = run_playbook("tests/roles/playbooks/textfile_writer.yml", inv, artifacts=tmp_path / "a1",
                         extravars=extravars)
    assert first.success and first.changed == 2
    again = run_playbook("tests/roles/playbooks/textfile_writer.yml", inv, artifacts=tmp_path / "a2",
                         extravars=extravars)
    assert again.success and again.changed == 0
    assert (libexec / "shardstack_textfile.py").stat().st_mode & 0o777 == 0o644

    script = Path(shutil.copy(PATROL, libexec / PATROL.name))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(["/usr/bin/python3", str(script), "--textfile-dir", str(out),
                           "--nvidia-smi-output", str(FIXTURES / "nvidia-smi-healthy.csv"),
                           "--kernel-log", str(FIXTURES / "kernel-xid.log"), "--dcgmi", ""],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "shardstack_gpu_health_" in (out / "shardstack_gpu_health.prom").read_text()
