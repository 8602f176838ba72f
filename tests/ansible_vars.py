"""Shared by the role-rendering tests: variables in the form Ansible's own Templar evaluates them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ansible.plugins.loader import init_plugin_loader
from ansible.template import trust_as_template

# Lookups in role variables and templates (fileglob, file) resolve as they do in a play.
init_plugin_loader()


def trusted(value: Any) -> Any:
    """Mark every string as a template, as Ansible does for variables it loads from a role's files."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def load_vars(path: Path) -> dict[str, Any]:
    """A role's vars/defaults file, or {} when the role has none."""
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
