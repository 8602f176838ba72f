"""The wheel carries the Ansible side (site.yml, playbooks, roles) so `pip install shardstack` can deploy outside a
checkout: build_py copies it into the package as `shardstack/_ansible`. Editable installs skip the copy: they find
the checkout itself (shardstack.ops.runner.project_dir)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ANSIBLE_TREE = ["site.yml", "ansible.cfg", "group_vars", "playbooks", "plugins", "roles", "inventory/sample"]


class BuildWithPlaybooks(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        here = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "shardstack" / "_ansible"
        shutil.rmtree(dest, ignore_errors=True)  # a reused build/ must not keep files the tree has dropped
        for name in ANSIBLE_TREE:
            src, out = here / name, dest / name
            if src.is_dir():
                shutil.copytree(src, out, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "credentials"))
            elif src.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)


setup(cmdclass={"build_py": BuildWithPlaybooks})
