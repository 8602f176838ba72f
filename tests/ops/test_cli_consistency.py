"""The CLI's consistency (issue 28): which inventory a command targets, `-e @file`, exit codes, `--json` on every
command that reports, names that mean one thing, cordon state outside the inventory, one set of serving defaults.
The real CLI in a subprocess (or `main([...])`), on local hosts or a loopback server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTACK_INVENTORY"}
    return {**env, **extra}


def shardstack(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, timeout=180,
                          cwd=cwd, env=env or _env())


def _local_inventory(path: Path, **groups: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hosts = sorted({h for members in groups.values() for h in members})
    path.write_text(json.dumps({"all": {
        "hosts": {h: {} for h in hosts},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "children": {g: {"hosts": {h: {} for h in members}} for g, members in groups.items()},
    }}))
    return path


# 1. Inventory selection ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["status"], ["deploy"], ["node", "cordon", "n1"], ["train", "logs", "job"],
                                  ["logs"], ["serve", "rollout"], ["artifacts", "prune"]])
def test_no_inventory_anywhere_is_one_clear_line(argv: list[str], tmp_path: Path) -> None:
    """No -i, no $SHARDSTACK_INVENTORY, no lab inventory here: exit 2 and one line, never the lab by accident."""
    proc = shardstack(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "shardstack: error: no inventory: pass -i PATH or set SHARDSTACK_INVENTORY\n"


def test_shardstack_inventory_wins_over_the_lab(tmp_path: Path) -> None:
    """A configured real inventory is used even where a lab inventory exists; -i wins over both."""
    _local_inventory(tmp_path / "inventory" / "lab" / "hosts.yml", train_nodes=["labnode"])
    real = _local_inventory(tmp_path / "prod" / "hosts.yml", train_nodes=["prodnode"])
    other = _local_inventory(tmp_path / "other" / "hosts.yml", train_nodes=["othernode"])
    # An unknown node's error lists the inventory's train nodes: which inventory was read.
    lab = shardstack("node", "cordon", "nope", cwd=tmp_path)
    assert lab.returncode == 2 and "nodes: labnode" in lab.stderr, lab.stderr
    env = shardstack("node", "cordon", "nope", cwd=tmp_path, env=_env(SHARDSTACK_INVENTORY=str(real)))
    assert env.returncode == 2 and "nodes: prodnode" in env.stderr, env.stderr
    flag = shardstack("node", "cordon", "nope", "-i", str(other), cwd=tmp_path,
                      env=_env(SHARDSTACK_INVENTORY=str(real)))
    assert flag.returncode == 2 and "nodes: othernode" in flag.stderr, flag.stderr
    missing = shardstack("status", cwd=tmp_path, env=_env(SHARDSTACK_INVENTORY=str(tmp_path / "gone.yml")))
    assert missing.returncode == 2 and "gone.yml does not exist" in missing.stderr
    assert "Traceback" not in lab.stderr + env.stderr + flag.stderr + missing.stderr


def test_help_says_where_the_default_inventory_comes_from() -> None:
    out = " ".join(shardstack("status", "--help").stdout.split())
    assert "$SHARDSTACK_INVENTORY when set, else inventory/lab/hosts.yml when it exists" in out


# 2. -e @FILE (what arrives, literally: tests/ops/test_template_injection.py) ---------------------------------------

@pytest.mark.parametrize("content, needle", [
    (None, "cannot read extra-vars file"),
    ("[1, 2]\n", "must hold a mapping"),
    ("a: [unclosed\n", "is not YAML or JSON"),
    ('{"not a name": 1}', "is not an identifier"),
    ("when: 2024-01-31\n", "quote dates"),
])
def test_bad_extra_vars_files_are_usage_errors(content: str | None, needle: str, tmp_path: Path) -> None:
    file = tmp_path / "vars.yml"
    if content is not None:
        file.write_text(content)
    inv = _local_inventory(tmp_path / "hosts.yml", train_nodes=["h1"])
    proc = shardstack("deploy", "-i", str(inv), "-e", f"@{file}")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# 3. Exit codes: 1 when a host failed or is unhealthy, 2 only for bad input ------------------------------------------
# (status: tests/ops/test_status.py; a HAProxy refusal: tests/ops/test_cordon.py)

def _with_a_down_node(path: Path, group: str) -> Path:
    """h1 answers (local); h2 is DOWN: ssh to a closed port, refused at once."""
    path.write_text(json.dumps({"all": {
        "vars": {"ansible_python_interpreter": sys.executable, "shardstack_scheduler": "systemd"},
        "children": {group: {"hosts": {
            "h1": {"ansible_connection": "local"},
            "h2": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 9,
                   "ansible_ssh_common_args": "-o ConnectTimeout=3 -o BatchMode=yes"}}}},
    }}))
    return path


def test_train_logs_exits_1_when_a_train_node_is_down(tmp_path: Path) -> None:
    inv = _with_a_down_node(tmp_path / "hosts.yml", "train_nodes")
    proc = shardstack("train", "logs", "job1", "-i", str(inv))
    assert proc.returncode == 1, proc.stderr
    assert "h1 | " in proc.stdout and "no journal from h2" in proc.stderr
    doc = shardstack("train", "logs", "job1", "-i", str(inv), "--json")
    assert doc.returncode == 1 and set(json.loads(doc.stdout)) == {"h1", "h2"}
    up = _local_inventory(tmp_path / "up.yml", train_nodes=["h1"])
    assert shardstack("train", "logs", "job1", "-i", str(up)).returncode == 0


def test_logs_exits_1_when_the_collector_is_down(tmp_path: Path) -> None:
    inv = _with_a_down_node(tmp_path / "hosts.yml", "monitoring_server")
    proc = shardstack("logs", "--collector", "h2", "-i", str(inv), "--json")
    assert proc.returncode == 1, proc.stderr
    assert "journalctl on the log collector h2 failed" in proc.stderr and "Traceback" not in proc.stderr
    assert shardstack("logs", "--since", "not a time", "-i", str(inv)).returncode == 2  # bad input: still 2


# 4. --json on every command that reports -------------------------------------------------------------------------

# What prints no report of its own: the inference server and the autoscaler (long-running: they log), a Ray unit's
# start step (the staged copy's path), and a command run inside a lab node (its output is the command's).
NO_REPORT = {("serve",), ("serve", "stage"), ("serve", "autoscale"), ("lab", "exec")}


def _leaf_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    from shardstack.cli import _COMMAND_MODULES, build_parser

    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if path and (not subs or not subs[0].required):  # runnable as it is (serve: with or without rollout)
            leaves[path] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk((*path, name), child)

    for name, _module, _help in _COMMAND_MODULES:
        top = build_parser([name])
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        walk((name,), sub.choices[name])
    return leaves


def test_every_command_that_reports_takes_json() -> None:
    leaves = _leaf_parsers()
    assert ("train", "run") in leaves and ("lab", "up") in leaves and ("serve", "rollout") in leaves
    missing = [" ".join(p) for p, parser in leaves.items()
               if p not in NO_REPORT and "--json" not in parser._option_string_actions]
    assert missing == []
    assert all("--json" not in leaves[p]._option_string_actions for p in NO_REPORT)


def test_docs_claim_json_only_for_commands_that_have_it() -> None:
    """Every `shardstack …` command line in README.md and docs/ that shows --json names a command that has it."""
    leaves = _leaf_parsers()
    claims = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            for m in re.finditer(r"shardstack ([^`\n]*)", line):
                if "--json" not in m[1]:
                    continue
                words = []
                for word in re.split(r"[ |\\]+", m[1]):  # the command words, up to the first option or argument
                    if not re.fullmatch(r"[a-z][a-z-]*", word):
                        break
                    words.append(word)
                # `node cordon|drain|uncordon`: each alternative is a command of its own
                heads = [tuple(words[:1]), *[(words[0], w) for w in words[1:]]]
                claims += [(doc.name, h) for h in heads if h in leaves]
    assert claims, "no --json claims found: the pattern is stale"
    wrong = [(doc, " ".join(cmd)) for doc, cmd in claims if "--json" not in leaves[cmd]._option_string_actions]
    assert wrong == []
    # The general claim names the exceptions.
    ops = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert ("Every command that reports takes `--json` (all but `shardstack serve` itself, the server, and `lab exec`, "
            "whose output is the command's)") in ops


def test_reports_are_one_json_document_on_stdout(tmp_path: Path) -> None:
    """Local commands with --json: stdout parses as one JSON object with the result's fields; rich stays off it."""
    text = tmp_path / "in.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    tok = shardstack("tokenizer", "train", str(text), "--vocab-size", "300", "--out", str(tmp_path / "tok"), "--json")
    assert tok.returncode == 0, tok.stderr
    doc = json.loads(tok.stdout)
    assert 256 < doc["vocab_size"] <= 300 and doc["files"] == 1 and len(doc["sha256"]) == 64
    prep = shardstack("data", "prepare", str(text), "--out", str(tmp_path / "data"), "--workers", "1", "--json")
    assert prep.returncode == 0, prep.stderr
    doc = json.loads(prep.stdout)
    assert doc["out"] == str(tmp_path / "data") and doc["total_tokens"] == 200 * 44 and doc["tokenizer"]
    labs = shardstack("lab", "list", "--json")
    assert labs.returncode == 0 and isinstance(json.loads(labs.stdout)["labs"], list)


# 5. Names that mean one thing: --inventory / -i is always an input ---------------------------------------------------

def test_lab_up_writes_its_inventory_with_write_inventory_only() -> None:
    from shardstack.cli import build_parser

    up = _leaf_parsers()[("lab", "up")]
    assert "--write-inventory" in up._option_string_actions
    assert "--inventory" not in up._option_string_actions and "-i" not in up._option_string_actions
    args = build_parser(["lab"]).parse_args(["lab", "up", "--write-inventory", "x/hosts.yml"])
    assert args.write_inventory == Path("x/hosts.yml")
    # The old name is gone (not an abbreviation of anything either): a usage error before anything boots.
    old = shardstack("lab", "up", "--name", "zz", "--inventory", "x.yml")
    assert old.returncode == 2 and "unrecognized arguments: --inventory" in old.stderr
    # Everywhere else --inventory is what the command reads.
    readers = [p for p, parser in _leaf_parsers().items() if "--inventory" in parser._option_string_actions]
    assert readers and all(parser._option_string_actions["--inventory"].dest == "inventory"
                           and parser._option_string_actions["-i"] is parser._option_string_actions["--inventory"]
                           for parser in (_leaf_parsers()[p] for p in readers))


# 7. One set of serving defaults: `shardstack serve`'s are the inference_service role's ----------------------------

# CLI option dest → the role variable that sets it on a node. The role's 0 means "leave the CLI's automatic value",
# which is None in argparse. Not mapped, on purpose: --host (the node's address vs loopback by hand), --model-name
# (the role serves exports/current, whose directory name means nothing), --tensor-parallel (the role's 0 is "every
# GPU of the node", counted on the node).
SERVE_DEFAULTS = {
    "port": "inference_service_port", "max_concurrency": "inference_service_max_concurrency",
    "max_queue": "inference_service_max_queue", "max_body_bytes": "inference_service_max_body_bytes",
    "max_tokens": "inference_service_max_tokens", "context": "inference_service_context",
    "max_prefill_tokens": "inference_service_max_prefill_tokens", "device": "inference_service_device",
    "dtype": "inference_service_dtype", "threads": "inference_service_threads",
    "drain_seconds": "inference_service_drain_seconds", "stall_seconds": "inference_service_watchdog_seconds",
    "kv_cache_gib": "inference_service_kv_cache_gib", "engine": "inference_service_engine",
}


def test_serve_defaults_are_the_roles() -> None:
    import yaml
    from shardstack.cli import build_parser

    role = yaml.safe_load((REPO / "roles/inference_service/defaults/main.yml").read_text())
    args = build_parser(["serve"]).parse_args(["serve"])
    cli = {dest: getattr(args, dest) for dest in SERVE_DEFAULTS}
    want = {dest: None if role[var] == 0 else role[var] for dest, var in SERVE_DEFAULTS.items()}
    assert cli == want
    # The settings object the CLI fills says the same where a caller leaves a field out.
    from shardstack.serve.settings import ServeSettings
    fields = {f.name: f.default for f in dataclasses.fields(ServeSettings)}
    same = ("max_concurrency", "max_queue", "max_tokens", "context", "max_body_bytes", "max_prefill_tokens", "dtype",
            "drain_seconds", "stall_seconds")
    assert {dest: fields[dest] for dest in same} == {dest: want[dest] for dest in same}
    help_text = " ".join(shardstack("serve", "--help").stdout.split())
    for flag, dest in (("--max-concurrency", "max_concurrency"), ("--max-queue", "max_queue"),
                       ("--drain-seconds", "drain_seconds")):
        assert f"(default {role[SERVE_DEFAULTS[dest]]})" in help_text, flag
    # docs/serving.md's options table says the same.
    table = (REPO / "docs/serving.md").read_text()
    for flag, dest in (("--max-concurrency N", "max_concurrency"), ("--max-queue N", "max_queue"),
                       ("--drain-seconds S", "drain_seconds"), ("--stall-seconds S", "stall_seconds"),
                       ("--max-prefill-tokens N", "max_prefill_tokens")):
        assert f"| `{flag}` | {role[SERVE_DEFAULTS[dest]]} |" in table, flag


# 8. What the docs claim ---------------------------------------------------------------------------------------------

def test_serving_md_example_unit_is_what_the_role_renders() -> None:
    """Every line of docs/serving.md's example unit is in the unit the role renders for that host (ExecStart: the
    same argv), and the CLI parses that ExecStart."""
    import shlex

    from shardstack.cli import build_parser

    from .conftest import render

    doc = (REPO / "docs/serving.md").read_text()
    block = doc[doc.index("```ini\n[Service]"):]
    block = block[len("```ini\n"):block.index("```", 3)]
    unit = render("inference_service", "shardstack-inference.service.j2", inventory_hostname="node2",
                  ansible_host="10.0.0.12")

    def settings(text: str) -> list[str]:
        joined = text.replace("\\\n", " ")
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]

    rendered = settings(unit)
    documented = settings(block)
    exec_doc = [line for line in documented if line.startswith("ExecStart=")]
    exec_unit = [line for line in rendered if line.startswith("ExecStart=")]
    assert len(exec_doc) == 1 and len(exec_unit) == 1
    assert shlex.split(exec_doc[0]) == shlex.split(exec_unit[0])
    assert [line for line in documented if not line.startswith("ExecStart=") and line not in rendered] == []
    argv = shlex.split(exec_doc[0].removeprefix("ExecStart="))
    assert build_parser(argv[1:]).parse_args(argv[1:]).model == Path("/srv/shardstack/exports/current")


def test_the_cli_reads_the_inventorys_group_vars_as_the_readme_says(tmp_path: Path) -> None:
    """README: settings go in the inventory's group_vars/, which the CLI reads (through ansible-inventory); the
    repository's group_vars/ sets nothing, so there is nothing there the CLI could miss."""
    import yaml
    from shardstack.ops import status as status_ops
    from shardstack.ops.inventory import Cluster

    readme = " ".join((REPO / "README.md").read_text().split())
    assert "read both by `site.yml` and by the wrapper" not in readme
    assert "Cluster-wide settings go in the inventory's `group_vars/`" in readme
    assert yaml.safe_load((REPO / "group_vars/all.yml").read_text()) == {}
    inv = tmp_path / "prod"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  children:\n    monitoring_server:\n      hosts:\n        mon:\n"
                                   "          ansible_host: 10.0.0.9\n")
    (inv / "group_vars" / "all.yml").write_text("prometheus_port: 9999\n")
    assert status_ops.sources(Cluster.load(inv))[0] == "http://10.0.0.9:9999"
