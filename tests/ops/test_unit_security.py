"""Every service unit the roles install, in every install mode, scored by `systemd-analyze security --offline` as
the node would load it (unit + the role's drop-ins): the exposure stays at or under the limit docs/operations.md
states (issue 13: inference 2.0, training 3.0, every exporter and monitoring unit 3.0). No skip: a missing tool or
package unit fails the test (`make setup` provides both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_vars import RoleEval
from unit_exposure import CASES, FACTS, Case, analyze, score

ROLES = Path(__file__).resolve().parents[2] / "roles"


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_unit_exposure_is_under_its_limit(case: Case, tmp_path: Path) -> None:
    result = score(case, tmp_path)
    assert result.exposure <= case.threshold, f"{case.label}: {result.exposure} > {case.threshold}\n{result.output}"
    assert result.passed, f"systemd-analyze's own --threshold check failed:\n{result.output}"
    # The drop-ins were really laid out, so the score is of the hardened unit.
    assert len(result.files) == 1 + len(case.dropins) + bool(case.hardening), result.files


def test_the_score_measures_the_sandboxing(tmp_path: Path) -> None:
    """The inference unit without its hardening block scores far worse (and over its limit): the score moves with
    the directives, so a passing test means they are there."""
    case = next(c for c in CASES if c.unit == "shardstack-inference.service")
    hardened = score(case, tmp_path)
    unit = tmp_path / hardened.files[0]
    text = unit.read_text()
    unit.write_text(text[:text.index("# Hardening")] + "\n[Install]\nWantedBy=multi-user.target\n")
    bare, passed, _ = analyze(tmp_path, case.unit, case.threshold)
    assert bare >= hardened.exposure + 3 and not passed


def hardening_includes() -> list[tuple[str, dict[str, Any]]]:
    """(role, task) for every task in the roles that reaches shardstack_common's hardening.yml."""
    found = []
    for path in sorted(ROLES.glob("*/tasks/*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            include = task.get("ansible.builtin.include_role") or {}
            if include.get("name") == "shardstack_common" and include.get("tasks_from") == "hardening.yml":
                found.append((path.parent.parent.name, task))
    return found


def test_every_installed_unit_is_scored() -> None:
    """A role that starts installing another unit template or systemd drop-in must add it to the table."""
    templates = {f"{p.parent.parent.name}/{p.name}" for p in ROLES.glob("*/templates/*.service.j2")}
    scored = {f"{c.role}/{c.template}" for c in CASES if c.template}
    assert templates == scored
    dropins = {f"{c.role}/{t}" for c in CASES for t, _ in c.dropins}
    assert all((ROLES / d.replace("/", "/templates/", 1)).is_file() for d in dropins), dropins
    # One sandboxing template for every role (shardstack_common's hardening.yml renders it) ...
    assert sorted(ROLES.glob("*/templates/*hardening*")) == [ROLES / "shardstack_common/templates/hardening.conf.j2"]
    # ... and every unit a role sandboxes with it is scored, with the settings that role passes it (each unit of a
    # loop, whatever the task's `when`).
    hardened = {}
    for role, task in hardening_includes():
        loop = task.get("loop", [None])
        for item in RoleEval(role, FACTS).template(loop):
            ev = RoleEval(role, FACTS, item=item)
            unit = ev.template(task["vars"]["__shardstack_common_hardening_unit"])
            hardened[f"{role}/{unit}"] = ev.template(task["vars"]["__shardstack_common_hardening"])
    assert hardened == {f"{c.role}/{c.unit_file.removesuffix('.service')}": RoleEval(c.role, FACTS)[c.hardening]
                        for c in CASES if c.hardening}
