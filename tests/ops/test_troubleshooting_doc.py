"""docs/troubleshooting.md stays true to the CLI and the alert rules: every `shardstack …` command line in it (code
spans and code blocks) parses with the real parser, and every alert the Prometheus rules define has a row or a
pointer there."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml
from shardstack.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "troubleshooting.md"
RULES = REPO / "roles" / "prometheus" / "files" / "rules"

# Placeholders the doc uses, and a value of the right type for each.
PLACEHOLDERS = {"HOST": "gpu01", "NODE": "gpu01", "JOB": "run1", "NAME": "run1", "N": "2", "DAYS": "14"}
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`]+)`")


def command_lines(text: str) -> list[str]:
    """Every `shardstack …` command: code spans in the prose and tables (a span may wrap a line), and the lines
    of code blocks that start with one (a trailing `# comment` dropped)."""
    commands = []
    for block in _FENCE.findall(text):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("shardstack "):
                commands.append(line)
    prose = _FENCE.sub("", text)
    for span in _SPAN.findall(prose):
        span = " ".join(span.split())
        if span.startswith("shardstack "):
            commands.append(span)
    return commands


def _exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviated options: argparse would take `--skip-tag` for `--skip-tags`; the doc spells them out."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _exact(sub)
    return parser


def parse_error(command: str) -> str | None:
    """None if the real `shardstack` parser accepts the command (placeholders replaced), else argparse's words."""
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(re.sub(r"<[^>]+>", "x1", command))][1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = _exact(build_parser(words)).parse_args(words)
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    if not getattr(args, "func", None):
        return "no command: the parser found nothing to run"
    return None


def alert_names() -> list[str]:
    names = []
    for path in sorted(RULES.glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names += [rule["alert"] for rule in group.get("rules", []) if "alert" in rule]
    return names


def test_the_doc_has_commands() -> None:
    commands = command_lines(DOC.read_text())
    assert len(commands) >= 40
    # Both schedulers' maintenance procedures are there.
    assert "shardstack deploy --limit gpu01 --skip-tags scheduler" in commands
    assert "shardstack node drain gpu01" in commands


def test_every_shardstack_command_in_the_doc_parses() -> None:
    bad = [f"`{c}`: {why}" for c in command_lines(DOC.read_text()) if (why := parse_error(c))]
    assert not bad, "docs/troubleshooting.md has commands the CLI refuses:\n" + "\n".join(bad)


@pytest.mark.parametrize("command", [
    "shardstack node drian HOST",                # a misspelled action
    "shardstack deploy --limt HOST",             # a misspelled option
    "shardstack deploy --limit HOST --skip-tag scheduler",  # an abbreviation argparse would accept
    "shardstack trian status JOB",               # a misspelled command
    "shardstack estimate --config job.yaml --stage 5",  # a value the parser does not take
    "shardstack node drain",                     # a missing argument
    "shardstack train",                          # a group without its action
])
def test_the_check_refuses_a_misspelled_command(command: str) -> None:
    assert parse_error(command) is not None


def test_the_check_sees_a_broken_command_in_a_doc() -> None:
    doc = "| a | b |\n| `shardstack node uncordon HOST` | `shardstack artifacts prune --dryrun` |\n"
    doc += ("```sh\nshardstack train submit --config job.yaml --name JOB --nodes N   # ok\n"
            "shardstack serve rolout\n```\n")
    commands = command_lines(doc)
    assert [c for c in commands if parse_error(c)] == ["shardstack serve rolout", "shardstack artifacts prune --dryrun"]


def test_every_alert_has_a_row_or_a_pointer() -> None:
    names = alert_names()
    assert len(names) >= 30
    text = DOC.read_text()
    missing = [n for n in names if not re.search(rf"`{n}`", text)]
    assert not missing, f"alerts without a row or pointer in docs/troubleshooting.md: {missing}"
