"""The molecule layout: one base config (.config/molecule/config.yml), scenarios that carry only what is theirs, and
the shared converge applying the role a scenario is named after."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_the_lab_release_is_chosen_by_the_environment_and_reaches_lab_up() -> None:
    """SHARDSTACK_LAB_RELEASE picks every scenario's lab release (bookworm when unset); create.yml hands it to
    `shardstack lab up --release`. SHARDSTACK_LAB_ACCELERATOR the nodes' torch build (auto when unset)."""
    from molecule.interpolation import Interpolator, TemplateWithDefaults

    raw = (REPO / ".config" / "molecule" / "config.yml").read_text()
    for env, want in (({}, "bookworm"), ({"SHARDSTACK_LAB_RELEASE": "trixie"}, "trixie")):
        text = Interpolator(TemplateWithDefaults, env).interpolate(raw)
        assert yaml.safe_load(text)["driver"]["lab_release"] == want
    for env, want in (({}, "auto"), ({"SHARDSTACK_LAB_ACCELERATOR": "cu130"}, "cu130")):
        text = Interpolator(TemplateWithDefaults, env).interpolate(raw)
        assert yaml.safe_load(text)["provisioner"]["inventory"]["group_vars"]["all"]["shardstack_accelerator"] == want
    create = yaml.safe_load((REPO / "molecule" / "resources" / "create.yml").read_text())
    argv = create[0]["tasks"][0]["ansible.builtin.command"]["argv"]
    assert argv[argv.index("--release") + 1] == "{{ molecule_yml.driver.lab_release | default('bookworm') }}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_holds_only_its_platforms_and_variables(name: str) -> None:
    scenario = _scenario(name)
    # default alone has its own test sequence: its e2e re-deploys site.yml from a wheel and wants 0 changed, which
    # is molecule's idempotence step done once instead of twice.
    assert set(scenario) <= {"platforms", "provisioner"} | ({"scenario"} if name == "default" else set()), \
        sorted(scenario)
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


def _converged_roles(playbook: Path) -> set[str]:
    """Roles a playbook applies (`roles:` entries, include_role/import_role names), following import_playbook."""
    found: set[str] = set()
    for play in yaml.safe_load(playbook.read_text()) or []:
        if "ansible.builtin.import_playbook" in play:
            found |= _converged_roles((playbook.parent / play["ansible.builtin.import_playbook"]).resolve())
            continue
        found |= {r["role"] if isinstance(r, dict) else r for r in play.get("roles", [])}
        for task in play.get("tasks", []) + play.get("pre_tasks", []):
            for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
                if key in task:
                    found.add(task[key]["name"])
    return found


def test_every_role_has_a_scenario() -> None:
    """A scenario named after the role, or one whose own converge applies it: munge is only ever deployed with
    Slurm, and its verify (a credential minted on one node, decoded on the other) is the slurm scenario's."""
    # shardstack_common has no tasks of its own to converge: every scenario of a role that uses it exercises it.
    without = set(ROLES) - set(SCENARIOS) - {"shardstack_common"}
    covered = {role: name for name in SCENARIOS if (REPO / "molecule" / name / "converge.yml").is_file()
               for role in _converged_roles(REPO / "molecule" / name / "converge.yml")}
    assert without <= set(covered), f"roles no scenario converges: {sorted(without - set(covered))}"
    assert covered.get("munge") == "slurm"


def test_default_skips_idempotence_for_the_e2e_redeploy_and_keeps_the_rest() -> None:
    base = yaml.safe_load((REPO / ".config" / "molecule" / "config.yml").read_text())["scenario"]["test_sequence"]
    own = _scenario("default")["scenario"]["test_sequence"]
    assert own == [step for step in base if step != "idempotence"]
    e2e = (REPO / "tests" / "e2e" / "test_cluster_e2e.py").read_text()
    assert '"deploy", "-i"' in e2e and '"--check"' not in e2e  # a real re-deploy, which must change nothing


@pytest.mark.parametrize(("scenario", "suite", "variable"), [
    ("default", "tests/e2e/test_cluster_e2e.py", "SHARDSTACK_E2E"),
    ("slurm", "tests/e2e/test_slurm_e2e.py", "SHARDSTACK_SLURM_INVENTORY"),
])
def test_a_verify_whose_e2e_skips_fails(scenario: str, suite: str, variable: str) -> None:
    """The e2e suites skip every test without their variable: the verify's own pytest command, run without it,
    must fail (--all-must-pass) instead of passing on skips."""
    cmd = next(task["ansible.builtin.shell"]["cmd"]
               for play in yaml.safe_load((REPO / "molecule" / scenario / "verify.yml").read_text())
               for task in play.get("tasks", []) if suite in str(task.get("ansible.builtin.shell", "")))
    assert f"{variable}=" in cmd
    argv = re.search(rf"pytest (.*?){re.escape(suite)}", cmd)
    assert argv, cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTACK_E2E") and k != variable}
    args = [a for a in argv.group(1).split() if not a.startswith("--junitxml")]  # not over the real run's file
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, suite], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "--all-must-pass: 0 of" in proc.stdout and "skipped" in proc.stdout, proc.stdout[-3000:]
