"""docs/quickstart-cluster.md stays true to the project: every `shardstack …` command in it parses with the real CLI
parser, every YAML block parses, the job config is one `train submit` accepts, the group_vars template sets every
production variable and only variables the roles declare (and, with the doc's hosts.yml, leaves `shardstack check`
nothing to warn about), the sample's `check` warnings shown are the real ones, and the README links the page near
its top."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml
from e2e.quickstart import _BLOCK, DOC, blocks, commands, section
from shardstack.build.variables import PRODUCTION, load_roles
from shardstack.cli import build_parser
from shardstack.ops import train as train_ops
from shardstack.ops.inventory import Cluster
from shardstack.ops.production import unset_production_variables, warning_lines

from .test_troubleshooting_doc import _exact, command_lines

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SHARED = "/srv/shardstack"


def doc_commands(text: str) -> list[str]:
    """`shardstack …` commands of the doc: the lines of its `sh` blocks and its code spans. Untagged blocks are
    expected output, never commands."""
    return command_lines(_BLOCK.sub(lambda m: m.group(0) if m.group(1).strip() == "sh" else "", text))


def parse_error(command: str) -> str | None:
    """None if the real parser accepts the command (`--version`/`--help`, which exit 0, included), else why not."""
    words = shlex.split(re.sub(r"<[^>]+>", "x1", command))[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = _exact(build_parser(words)).parse_args(words)
    except SystemExit as exc:
        if exc.code == 0 and {"--version", "--help", "-h"} & set(words):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    if not getattr(args, "func", None):
        return "no command: the parser found nothing to run"
    return None


def yaml_block(first_line: str) -> str:
    found = [b for b in blocks(DOC.read_text(), "yaml") if b.startswith(first_line)]
    assert len(found) == 1, f"one yaml block starting {first_line!r} in the doc, found {len(found)}"
    return found[0]


def declared_variables() -> set[str]:
    """Every variable some role declares: its meta/argument_specs.yml options or its defaults/main.yml."""
    names = {name for role in load_roles() for name in role.option_names()}
    for defaults in (REPO / "roles").glob("*/defaults/main.yml"):
        names |= set(yaml.safe_load(defaults.read_text()) or {})
    return names


def test_the_walkthrough_uses_the_commands_of_each_step() -> None:
    commands = doc_commands(DOC.read_text())
    for wanted in ("shardstack check -i inventory/prod", "shardstack deploy -i inventory/prod",
                   "shardstack validate -i inventory/prod", "shardstack train submit --config job.yaml --name run1",
                   "shardstack train status run1", "shardstack serve publish run1", "shardstack status"):
        assert wanted in commands, wanted
    assert any(c.startswith("shardstack model put ") for c in commands)
    assert any(c.startswith("shardstack data prepare --cluster ") for c in commands)
    assert any(c.startswith("shardstack logs ") for c in commands)


def test_every_shardstack_command_in_the_doc_parses() -> None:
    commands = doc_commands(DOC.read_text())
    assert len(commands) >= 20
    bad = [f"`{c}`: {why}" for c in commands if (why := parse_error(c))]
    assert not bad, "docs/quickstart-cluster.md has commands the CLI refuses:\n" + "\n".join(bad)


@pytest.mark.parametrize("command", [
    "shardstack serve publsh run1",                       # a misspelled action
    "shardstack data prepare --clustr corpus --out-name x",  # a misspelled option
    "shardstack model put",                               # a missing argument
    "shardstack --versions",
])
def test_the_check_refuses_a_broken_command(command: str) -> None:
    assert parse_error(command) is not None


def test_output_blocks_are_not_taken_for_commands() -> None:
    doc = "```sh\nshardstack status   # ok\n```\n\n```\nshardstack 0.1.0\n```\n"
    assert doc_commands(doc) == ["shardstack status"]


def test_every_yaml_block_parses() -> None:
    found = blocks(DOC.read_text(), "yaml")
    assert len(found) >= 3
    for body in found:
        assert isinstance(yaml.safe_load(body), dict), body[:80]


def test_every_python_block_compiles() -> None:
    for body in blocks(DOC.read_text(), "python"):
        compile(body, str(DOC), "exec")


def test_the_job_config_is_one_train_submit_accepts(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml_block("# job.yaml"))
    config = train_ops.load_job(path)  # the loader `train submit` validates with, before any node sees it
    assert config["name"] == "run1"
    train_ops.check_shared_paths(config, SHARED)  # every path on shared storage, as submit requires
    assert config["model"]["init_from"].startswith(SHARED + "/pretrained/")


def test_the_group_vars_template_sets_every_production_variable_and_only_declared_ones() -> None:
    template = yaml.safe_load(yaml_block("# inventory/prod/group_vars/all.yml"))
    missing = [v.name for v in PRODUCTION if v.name not in template]
    assert not missing, f"production variables the template leaves out: {missing}"
    unknown = sorted(set(template) - declared_variables())
    assert not unknown, f"variables no role declares: {unknown}"


def test_the_template_and_hosts_leave_check_nothing_to_warn_about(tmp_path: Path) -> None:
    inv = tmp_path / "prod"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(yaml_block("# inventory/prod/hosts.yml"))
    (inv / "group_vars" / "all.yml").write_text(yaml_block("# inventory/prod/group_vars/all.yml"))
    cluster = Cluster.load(inv)
    assert cluster.problems() == []
    assert [u.name for u in unset_production_variables(cluster)] == []


def test_the_sample_warnings_shown_are_the_real_ones() -> None:
    shown = [line for body in blocks(DOC.read_text(), "") for line in body.splitlines()
             if line.startswith("warning: production:")]
    sample = Cluster.load(REPO / "inventory" / "sample")
    real = [f"warning: {line}" for line in warning_lines(unset_production_variables(sample))]
    assert shown == real


def test_the_sections_the_e2e_walks_have_the_commands_it_runs() -> None:
    """tests/e2e/quickstart.py reads these sections' commands and runs them on the lab in this shape: a doc edit that
    changes it fails here, not 15 minutes into the e2e."""
    walked = {n: commands(n) for n in (4, 6, 7, 8, 9, 10, 11)}
    assert [len(c) for c in walked.values()] == [1, 1, 2, 3, 1, 1, 4], walked
    assert walked[8][0] == "shardstack train submit --config job.yaml --name run1" and walked[9] == [
        "shardstack serve publish run1"]
    assert walked[10][0].startswith("curl ") and walked[11][1] == "shardstack status --watch 10"
    assert len(blocks(section(10), "python")) == 1


def test_the_readme_links_the_quickstart_near_its_top() -> None:
    head = README.read_text().splitlines()[:40]
    assert any("docs/quickstart-cluster.md" in line for line in head)
