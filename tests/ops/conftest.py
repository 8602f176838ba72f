"""Helpers for the ops tests: render a role's templates with Ansible's own Templar, as the role would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_vars import load_vars, trusted

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"


def render(role: str, template: str, **variables: Any) -> str:
    """Render roles/<role>/templates/<template> with the role's defaults, overridden by `variables`."""
    defaults = load_vars(ROLES / role / "defaults" / "main.yml")
    layered = {**defaults, "ansible_managed": "Ansible managed", **variables}
    templar = Templar(loader=DataLoader(), variables=trusted(layered))
    return templar.template(trust_as_template((ROLES / role / "templates" / template).read_text()))
