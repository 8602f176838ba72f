"""The project's roles as the controller sees them: a role's default for a variable (roles/<role>/defaults/main.yml),
what a setting falls back to when the inventory leaves it unset."""

from __future__ import annotations

from typing import Any

from shardstack.ops.runner import project_dir


def role_default(role: str, name: str) -> Any:
    import yaml

    return yaml.safe_load((project_dir() / "roles" / role / "defaults" / "main.yml").read_text())[name]
