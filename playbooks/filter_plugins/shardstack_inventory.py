"""Filters for the preflight play: which `<role>_*` variables exist, and which inventory variables do not.

The known set is read from the roles themselves (defaults and meta/argument_specs.yml) and from the repository's
group_vars, so it stays true as roles are added: nothing here lists a role or a variable by name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

SHARDSTACK_PREFIX = "shardstack_"


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def known_variables(repo_root: str) -> dict[str, list[str]]:
    """Return {"prefixes": [...], "known": [...]} for the roles under `repo_root`/roles.

    A role's variables are its defaults and its argument_specs options (a test keeps the two equal); the shared
    `shardstack_*` variables are shardstack_common's (a role like any other here) and the `shardstack_*` keys of the
    repository's group_vars files.
    """
    root = Path(repo_root)
    prefixes: set[str] = {SHARDSTACK_PREFIX}
    known: set[str] = set()
    for role in sorted(p for p in (root / "roles").iterdir() if p.is_dir()) if (root / "roles").is_dir() else []:
        prefixes.add(role.name + "_")
        defaults = _load(role / "defaults" / "main.yml")
        if isinstance(defaults, Mapping):
            known.update(defaults)
        specs = _load(role / "meta" / "argument_specs.yml")
        for spec in (specs.get("argument_specs") or {}).values() if isinstance(specs, Mapping) else []:
            known.update((spec or {}).get("options") or {})
    for gv in sorted((root / "group_vars").glob("*.y*ml")) if (root / "group_vars").is_dir() else []:
        data = _load(gv)
        if isinstance(data, Mapping):
            known.update(k for k in data if str(k).startswith(SHARDSTACK_PREFIX))
    return {"prefixes": sorted(prefixes), "known": sorted(known)}


def unknown_variables(names: Iterable[str], catalog: Mapping[str, list[str]]) -> list[str]:
    """Messages for each name that carries a known prefix but is not a known variable (typos, removed options)."""
    known = set(catalog["known"])
    prefixes = tuple(catalog["prefixes"])
    out = []
    for name in sorted(set(names)):
        if not name.startswith(prefixes) or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        out.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return out


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "shardstack_known_variables": known_variables,
            "shardstack_unknown_variables": unknown_variables,
        }
