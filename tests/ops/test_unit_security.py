"""Every service unit the roles install, in every install mode, scored by `systemd-analyze security --offline` as
the node would load it (unit + the role's drop-ins): the exposure stays at or under the limit docs/operations.md
states (issue 13: inference 2.0, training 3.0, every exporter and monitoring unit 3.0). No skip: a missing tool or
package unit fails the test (`make setup` provides both)."""

from __future__ import annotations

from pathlib import Path

import pytest
from unit_exposure import CASES, Case, analyze, score


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_unit_exposure_is_under_its_limit(case: Case, tmp_path: Path) -> None:
    result = score(case, tmp_path)
    assert result.exposure <= case.threshold, f"{case.label}: {result.exposure} > {case.threshold}\n{result.output}"
    assert result.passed, f"systemd-analyze's own --threshold check failed:\n{result.output}"
    # The drop-ins were really laid out, so the score is of the hardened unit.
    assert len(result.files) == 1 + len(case.dropins), result.files


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


def test_every_installed_unit_is_scored() -> None:
    """A role that starts installing another unit template or systemd drop-in must add it to the table."""
    roles = Path(__file__).resolve().parents[2] / "roles"
    templates = {f"{p.parent.parent.name}/{p.name}" for p in roles.glob("*/templates/*.service.j2")}
    scored = {f"{c.role}/{c.template}" for c in CASES if c.template}
    assert templates == scored
    dropins = {f"{p.parent.parent.name}/{p.name}" for p in roles.glob("*/templates/*hardening.conf.j2")}
    assert dropins == {f"{c.role}/{t}" for c in CASES for t, _ in c.dropins if "hardening" in t}
