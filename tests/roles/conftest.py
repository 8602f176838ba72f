"""Evaluate a role's variables and templates with Ansible's own templating engine, without a host.

The role's defaults, vars/main.yml and vars/<family>.yml are layered as Ansible would (defaults lowest); the test
supplies facts, registered detection results and overrides. Values are marked trusted the way Ansible marks files
it loads itself, so Jinja in them is evaluated (ansible-core >= 2.19 refuses untrusted templates).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_vars import load_vars, trusted

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"

DEBIAN12_CONTAINER: dict[str, Any] = {
    "virtualization_type": "container",
    "architecture": "x86_64",
    "kernel": "6.1.0-28-amd64",
    "os_family": "Debian",
    "distribution": "Debian",
    "distribution_major_version": "12",
    "distribution_version": "12.8",
    "interfaces": ["lo", "eth0"],
    "eth0": {"device": "eth0", "ipv4": {"address": "10.0.0.11"}},
    "lo": {"device": "lo", "ipv4": {"address": "127.0.0.1"}},
    "default_ipv4": {},
}


class RoleEval:
    """A role's variable namespace for one imaginary host."""

    def __init__(self, role: str, facts: dict[str, Any], **overrides: Any) -> None:
        self.role = ROLES / role
        family = facts.get("distribution", "")
        vars_file = self.role / "vars" / f"{family}.yml"
        if not vars_file.is_file():
            vars_file = self.role / "vars" / f"{facts.get('os_family', '')}.yml"
        layered: dict[str, Any] = {}
        for part in (
            load_vars(self.role / "defaults" / "main.yml"),
            load_vars(self.role / "vars" / "main.yml"),
            load_vars(vars_file),
        ):
            layered.update(part)
        layered.update(overrides)
        layered.setdefault("inventory_hostname", "node1")
        layered.setdefault("ansible_managed", "Ansible managed")
        layered.setdefault("groups", {"all": [layered["inventory_hostname"]]})
        layered["ansible_facts"] = facts
        self.templar = Templar(loader=DataLoader(), variables=trusted(layered))

    def __getitem__(self, name: str) -> Any:
        return self.templar.template(trust_as_template("{{ " + name + " }}"))

    def render(self, template: str) -> str:
        text = (self.role / "templates" / template).read_text()
        return self.templar.template(trust_as_template(text))


def found(*paths: str) -> dict[str, Any]:
    """What ansible.builtin.find registers for the given matches."""
    return {"files": [{"path": p} for p in paths], "matched": len(paths)}


@pytest.fixture
def debian_container() -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEBIAN12_CONTAINER.items()}


@pytest.fixture
def role_eval() -> type[RoleEval]:
    return RoleEval


@pytest.fixture
def find_result() -> Any:
    return found
