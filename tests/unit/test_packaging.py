"""What ships: the Ansible collection (`ansible-galaxy collection build`) and the wheel both carry site.yml, the
playbooks and every role, and nothing of the tests or the lab. The e2e installs that wheel in a fresh venv and runs
`shardstack deploy --check` with it from outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
PLAYBOOKS = sorted(p.name for p in (ROOT / "playbooks").glob("*.yml"))


def test_the_collection_builds_with_every_role_and_playbook_and_passes_a_syntax_check(tmp_path: Path) -> None:
    subprocess.run([BIN / "ansible-galaxy", "collection", "build", "--force", "--output-path", tmp_path, ROOT],
                   check=True, capture_output=True)
    (archive,) = tmp_path.glob("shardstack-cluster-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "c", filter="data")
    top = {n.split("/")[0] for n in names}
    assert {"site.yml", "roles", "playbooks", "MANIFEST.json"} <= top
    assert not top & {"runtime", "tests", "molecule", "bench", ".venv", "artifacts"}, top
    assert sorted({n.split("/")[1] for n in names if n.startswith("roles/") and n.count("/") > 1}) == ROLES
    assert {n.split("/")[1] for n in names if n.startswith("playbooks/")} >= set(PLAYBOOKS)
    c = tmp_path / "c"
    env = {**os.environ, "ANSIBLE_CONFIG": str(c / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(c / "roles")}
    proc = subprocess.run([BIN / "ansible-playbook", "--syntax-check", "-i", c / "inventory/sample/hosts.yml",
                           c / "site.yml"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_wheel_carries_site_yml_the_playbooks_and_every_role(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path, ROOT], check=True,
                   capture_output=True)
    (wheel,) = tmp_path.glob("shardstack-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tree = {n.removeprefix("shardstack/_ansible/") for n in names if n.startswith("shardstack/_ansible/")}
    assert {"site.yml", "ansible.cfg", "inventory/sample/hosts.yml"} <= tree
    assert sorted({n.split("/")[1] for n in tree if n.startswith("roles/")}) == ROLES
    assert {n.split("/")[1] for n in tree if n.startswith("playbooks/")} >= set(PLAYBOOKS)
    assert not [n for n in tree if "/credentials/" in n or n.endswith(".pyc")]
