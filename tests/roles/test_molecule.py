"""The molecule layout: one base config (.config/molecule/config.yml), scenarios that carry only what is theirs, and
the shared converge applying the role a scenario is named after."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (REPO / "molecule").glob("*/molecule.yml"))
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks").is_dir())


def _scenario(name: str) -> dict:
    return yaml.safe_load((REPO / "molecule" / name / "molecule.yml").read_text())


def test_base_config_holds_what_is_common() -> None:
    base = yaml.safe_load((REPO / ".config" / "molecule" / "config.yml").read_text())
    assert base["provisioner"]["playbooks"] == {
        "create": "../resources/create.yml",
        "destroy": "../resources/destroy.yml",
        "converge": "../resources/converge.yml",
    }
    assert "verify" in base["scenario"]["test_sequence"] and "idempotence" in base["scenario"]["test_sequence"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_holds_only_its_platforms_and_variables(name: str) -> None:
    scenario = _scenario(name)
    assert set(scenario) <= {"platforms", "provisioner"}, sorted(scenario)
    assert set(scenario.get("provisioner", {})) <= {"inventory", "playbooks"}
    assert scenario["platforms"], "no lab node"


@pytest.mark.parametrize("name", SCENARIOS)
def test_own_converge_only_where_declared_else_a_role_of_that_name(name: str) -> None:
    """The base config points every scenario at the shared converge: a converge.yml left in a scenario without its
    molecule.yml naming it would be ignored silently, and the shared one needs a role named like the scenario."""
    own = (REPO / "molecule" / name / "converge.yml").is_file()
    declared = _scenario(name).get("provisioner", {}).get("playbooks", {}).get("converge")
    assert declared == ("converge.yml" if own else None)
    assert own or name in ROLES, f"{name}: no converge.yml and no role of that name"


def test_every_role_has_a_scenario() -> None:
    # shardstack_common has no tasks of its own to converge: every scenario of a role that uses it exercises it.
    assert set(ROLES) - set(SCENARIOS) == {"shardstack_common"}
