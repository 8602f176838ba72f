"""bench/deploy_scale.py's profile: each task's wall from ansible-runner's events, a handler's once per flush."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import ansible_runner
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "deploy_scale.py"

# One handler notified before two flushes, with an 8 s pause between them (no CPU: the bound holds under load): one
# task uuid, two runs.
PLAY = """
- name: Profile
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Change one
      ansible.builtin.command: "true"
      changed_when: true
      notify: Handler
    - name: Flush one
      ansible.builtin.meta: flush_handlers
    - name: Between the flushes
      ansible.builtin.pause:
        seconds: 8
    - name: Change two
      ansible.builtin.command: "true"
      changed_when: true
      notify: Handler
  handlers:
    - name: Handler
      ansible.builtin.command: "true"
"""


def _bench(name: str) -> type:
    spec = importlib.util.spec_from_file_location("deploy_scale", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_a_handler_run_at_two_flushes_is_two_runs_not_one_span_over_the_tasks_between(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "play.yml").write_text(PLAY)
    profile = _bench("Profile")()
    inventory = f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}"
    run = ansible_runner.run(private_data_dir=str(tmp_path), playbook="play.yml", inventory=inventory, quiet=True,
                             event_handler=lambda event: profile(event) or True)
    assert run.rc == 0, run.stdout.read()
    walls = dict(profile.top(10))
    assert walls["Between the flushes"] >= 8
    # Its two runs add up to less than the pause between them (one span over both took the pause in).
    assert 0 < walls["Handler"] < walls["Between the flushes"], walls
    # Tasks with a host result: the handler counts once (flush_handlers has none).
    assert profile.makeup()["tasks"] == 4, profile.makeup()


# 1.5 s of CPU (process time, so it holds under load) in a module's command: the controller side counts it through
# the processes it reaped, the machine's busy time holds it, and so does a cgroup holding them (here this test's own,
# where a lab node's cgroup is in the bench).
BUSY = "import time\nwhile time.process_time() < 1.5:\n    pass\n"


def test_the_cpu_of_a_run_counts_what_its_modules_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.startswith("0::"))
    unified = Path("/sys/fs/cgroup/unified")
    cgroup = (unified if unified.is_dir() else Path("/sys/fs/cgroup")) / own.strip().lstrip("/")
    assert (cgroup / "cpu.stat").is_file(), cgroup
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "busy.py").write_text(BUSY)
    (tmp_path / "project" / "play.yml").write_text(f"""
- name: Busy
  hosts: localhost
  gather_facts: false
  tasks:
    - name: A second and a half of CPU
      ansible.builtin.command:
        argv: ["{sys.executable}", "{tmp_path / 'project' / 'busy.py'}"]
""")
    inventory = f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}"
    with _bench("Cpu")([cgroup]) as cpu:
        run = ansible_runner.run(private_data_dir=str(tmp_path), playbook="play.yml", inventory=inventory,
                                 quiet=True)
    assert run.rc == 0, run.stdout.read()
    c = cpu.result
    assert c["controller_cpu_s"] >= 1.5 and c["nodes_cpu_s"] >= 1.5 and c["busy_cpu_s"] >= 1.5, c
    assert 0 < c["busy_share"] <= 1, c
