"""docs/variables.md is what the generator makes of the roles' argument_specs now, every role is in it, and the
production list names only variables the roles really have."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from shardstack.build.variables import PRODUCTION, diff, generate, load_roles, main

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
PAGE = REPO / "docs" / "variables.md"


def test_committed_page_is_current() -> None:
    expected, current = generate(ROLES), PAGE.read_text()
    assert current == expected, ("docs/variables.md is stale: run `make docs-variables` and commit it\n"
                                 + diff(current, expected, "docs/variables.md"))


def test_every_role_with_argument_specs_has_a_section_with_each_variable() -> None:
    page = PAGE.read_text()
    with_specs = sorted(d.name for d in ROLES.iterdir() if (d / "meta" / "argument_specs.yml").is_file())
    assert [r.name for r in load_roles(ROLES)] == with_specs
    for role in load_roles(ROLES):
        assert f"\n## {role.name}\n" in page
        for name in role.option_names():
            assert f"| `{name}` |" in page, f"{role.name}: {name} missing from docs/variables.md"


def test_every_production_variable_is_in_its_roles_spec() -> None:
    roles = {r.name: r for r in load_roles(ROLES)}
    every_option = set().union(*(r.option_names() for r in roles.values()))
    for var in PRODUCTION:
        assert var.role in roles, f"PRODUCTION names role {var.role}, which has no argument_specs"
        assert var.name in roles[var.role].option_names(), f"PRODUCTION: {var.role} has no variable {var.name}"
        if var.only_if:
            assert var.only_if[0] in every_option, f"PRODUCTION: {var.name} depends on unknown {var.only_if[0]}"
    assert len({v.name for v in PRODUCTION}) == len(PRODUCTION)


def test_production_variables_are_marked_in_their_rows_and_listed_with_a_reason() -> None:
    page = PAGE.read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    for var in PRODUCTION:
        assert "**production**" in rows[f"`{var.name}`"].split(" | ")[3]
        assert f"| `{var.name}` | [{var.role}](#{var.role}) | {var.group}" in page
    marked = [name for name, line in rows.items() if "**production**" in line]
    assert sorted(marked) == sorted({f"`{v.name}`" for v in PRODUCTION})


def test_a_changed_spec_changes_the_page(tmp_path: Path) -> None:
    roles = tmp_path / "roles"
    shutil.copytree(ROLES / "munge", roles / "munge")
    before = generate(roles)
    spec_file = roles / "munge" / "meta" / "argument_specs.yml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["argument_specs"]["main"]["options"]["munge_key_file"]["description"] = "Where munged | reads <the> key."
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    after = generate(roles)
    assert after != before
    assert "| Where munged \\| reads &lt;the&gt; key. |" in after  # one cell: the pipe escaped, no HTML tag
    assert "## munge" in after and "## grafana" not in after


def test_defaults_are_compact_and_fall_back_to_defaults_main(tmp_path: Path) -> None:
    roles = tmp_path / "roles"
    shutil.copytree(ROLES / "munge", roles / "munge")
    spec_file = roles / "munge" / "meta" / "argument_specs.yml"
    spec = yaml.safe_load(spec_file.read_text())
    del spec["argument_specs"]["main"]["options"]["munge_packages"]["default"]
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    page = generate(roles)
    assert "| `munge_packages` | list of str | `[munge]` |" in page  # from defaults/main.yml
    assert "| `munge_key` | str | `\"\"` |" in page
    firewall = generate(ROLES)
    plan = next(line for line in firewall.splitlines() if line.startswith("| `firewall_port_plan` |"))
    assert "items (roles/firewall/defaults/main.yml)" in plan.split(" | ")[2]


def test_check_mode_reports_a_stale_page(tmp_path: Path, capsys) -> None:
    page = tmp_path / "variables.md"
    assert main(["--write", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    page.write_text(page.read_text().replace("## munge\n", "## mung\n"))
    assert main(["--check", str(page)]) == 1
    captured = capsys.readouterr()
    assert "-## mung\n+## munge\n" in captured.out and "make docs-variables" in captured.err
