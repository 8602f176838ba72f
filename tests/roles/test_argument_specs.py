"""Every role's meta/argument_specs.yml mirrors its defaults — for every role under roles/, present or future: each
default is declared by an entry point (most by `main`; inference_service's autoscaler variables by `autoscaler`),
with the same value, and `main` declares nothing that has no default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
# shardstack_common has task files but no tasks/main.yml: the other roles reach it with tasks_from.
ALL_ROLES = sorted(p.name for p in ROLES.iterdir() if (p / "tasks").is_dir())
# What every role shares is prefixed shardstack_ (docs/roles.md); a role's own variables, <role>_.
PREFIX = {"shardstack_common": "shardstack_"}


def _defaults(role: str) -> dict:
    path = ROLES / role / "defaults" / "main.yml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _options(role: str, entry: str | None = "main") -> dict:
    """An entry point's options; entry None: every entry point's."""
    path = ROLES / role / "meta" / "argument_specs.yml"
    assert path.is_file(), f"{role}: meta/argument_specs.yml is missing"
    specs = yaml.safe_load(path.read_text())["argument_specs"]
    return {k: o for name, spec in specs.items() if entry in (None, name)
            for k, o in (spec.get("options") or {}).items()}


def test_roles_found() -> None:
    expected = {"os_baseline", "nvidia_driver", "cuda_toolkit", "nccl", "rdma", "shared_storage", "shardstack_common"}
    assert expected <= set(ALL_ROLES)


@pytest.mark.parametrize("role", ALL_ROLES)
def test_spec_keys_equal_defaults_keys(role: str) -> None:
    defaults, main, every = set(_defaults(role)), set(_options(role)), set(_options(role, None))
    assert defaults <= every and main <= defaults, (
        f"{role}: in no entry point {sorted(defaults - every)}, in main without a default {sorted(main - defaults)}"
    )


@pytest.mark.parametrize("role", ALL_ROLES)
def test_spec_defaults_equal_defaults_values(role: str) -> None:
    defaults, options = _defaults(role), _options(role, None)
    wrong = {
        k: (defaults[k], o["default"])
        for k, o in options.items()
        if k in defaults and "default" in o and o["default"] != defaults[k]
    }
    missing = sorted(k for k, o in options.items() if "default" not in o and not o.get("required"))
    assert not wrong, f"{role}: defaults differ (defaults.yml, argument_specs): {wrong}"
    assert not missing, f"{role}: options without a default that are not required: {missing}"


@pytest.mark.parametrize("role", ALL_ROLES)
def test_variables_are_role_prefixed_and_described(role: str) -> None:
    options, prefix = _options(role, None), PREFIX.get(role, role + "_")
    unprefixed = [k for k in options if not k.startswith(prefix)]
    assert not unprefixed, f"{role}: unprefixed {unprefixed}"
    assert all(o.get("description") for o in options.values()), f"{role}: options without a description"
