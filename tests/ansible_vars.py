"""Shared by the role-rendering tests: a role's variables and templates evaluated by Ansible's own Templar,
without a host.

The role's defaults, vars/main.yml and vars/<distribution or family>.yml are layered as Ansible would (defaults
lowest, each over those of the roles it depends on); the test supplies facts, registered results and overrides.
Values are marked trusted the way Ansible marks files it loads itself, so Jinja in them is evaluated (ansible-core
>= 2.19 refuses untrusted templates)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import add_all_plugin_dirs, init_plugin_loader
from ansible.template import Templar, trust_as_template

# Lookups in role variables and templates (fileglob, file) resolve as they do in a play, and so do the filters a
# play sees: the roles' own filter_plugins/ and those next to the playbooks (shardstack_accelerator).
init_plugin_loader()
REPO = Path(__file__).resolve().parent.parent
for _dir in [REPO / "playbooks", *sorted((REPO / "roles").iterdir())]:
    add_all_plugin_dirs(str(_dir))


def load_module(path: Path) -> ModuleType:
    """A plugin or module file of a role or playbook (not a package), imported as Ansible would load it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def trusted(value: Any) -> Any:
    """Mark every string as a template, as Ansible does for variables it loads from a role's files."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def _read(path: Path) -> dict[str, Any]:
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def dependencies(role_dir: Path) -> list[Path]:
    """The roles under `dependencies` in a role's meta/main.yml (names or `{role: name}`), as directories."""
    deps = _read(role_dir / "meta" / "main.yml").get("dependencies") or []
    return [role_dir.parent / (d["role"] if isinstance(d, dict) else d) for d in deps]


def load_vars(path: Path) -> dict[str, Any]:
    """A role's vars/defaults file, or {} when the role has none.

    Like Ansible, a role's defaults/main.yml and vars/main.yml come layered over those of the roles it depends on
    (meta/main.yml): `training_runtime_shared_dir: "{{ shardstack_shared_dir }}"` needs shardstack_common's."""
    if path.name != "main.yml" or path.parent.name not in ("defaults", "vars"):
        return _read(path)
    layered: dict[str, Any] = {}
    for dep in dependencies(path.parent.parent):
        layered.update(load_vars(dep / path.parent.name / "main.yml"))
    return {**layered, **_read(path)}


ROLES = REPO / "roles"


class RoleEval:
    """One role's variable namespace for one imaginary host with the given facts."""

    def __init__(self, role: str, facts: dict[str, Any], **overrides: Any) -> None:
        self.role = ROLES / role
        vars_file = self.role / "vars" / f"{facts.get('distribution', '')}.yml"
        if not vars_file.is_file():
            vars_file = self.role / "vars" / f"{facts.get('os_family', '')}.yml"
        layered: dict[str, Any] = {}
        for part in (load_vars(self.role / "defaults" / "main.yml"), load_vars(self.role / "vars" / "main.yml"),
                     load_vars(vars_file)):
            layered.update(part)
        layered.update(overrides)
        layered.setdefault("inventory_hostname", "node1")
        layered.setdefault("ansible_managed", "Ansible managed")
        layered.setdefault("groups", {"all": [layered["inventory_hostname"]]})
        layered["ansible_facts"] = facts
        self.variables = trusted(layered)
        self.templar = Templar(loader=DataLoader(), variables=self.variables)

    def __getitem__(self, name: str) -> Any:
        return self.templar.template(trust_as_template("{{ " + name + " }}"))

    def template(self, value: Any) -> Any:
        """A value as a role's file holds it (a string with Jinja, or a list or dict of them), evaluated."""
        return self.templar.template(trusted(value))

    def render(self, template: str) -> str:
        return self.templar.template(trust_as_template((self.role / "templates" / template).read_text()))

    def render_common(self, template: str, **include_vars: Any) -> str:
        """shardstack_common's templates/<template> as a task file of it renders it when this role reaches it with
        include_role: this role's variables plus the include's `vars:` (templates, as in the task)."""
        path = self.role.parent / "shardstack_common" / "templates" / template
        included = {"ansible_parent_role_names": [self.role.name], **include_vars}
        templar = Templar(loader=DataLoader(), variables={**self.variables, **trusted(included)})
        return templar.template(trust_as_template(path.read_text()))

    def render_hardening(self, settings: str, unit: str) -> str:
        """The sandboxing drop-in shardstack_common's hardening.yml writes for `unit` (no .service) from the settings
        `{{ settings }}` evaluates to in this role: "__grafana_hardening", "__prometheus_hardening[0].settings"."""
        return self.render_common("hardening.conf.j2", __shardstack_common_hardening_unit=unit,
                                  __shardstack_common_hardening="{{ " + settings + " }}")
