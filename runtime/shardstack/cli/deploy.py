"""`shardstack deploy | check | validate`: the cluster's playbooks through ansible-runner, with live progress.

deploy runs site.yml, check the preflight (inventory shape, every node reachable, facts), validate the
post-deploy checks (playbooks/validate.yml) and prints their report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console, summary_table
from shardstack.errors import ShardstackError
from shardstack.node.allreduce import busbw_floor
from shardstack.ops.production import unset_production_variables, warning_lines
from shardstack.ops.runner import RunResult, run_playbook
from shardstack.ops.validate import node_facts, run_validate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="run site.yml (or tagged parts of it) through ansible-runner")
    add_run_args(p)
    p.set_defaults(func=_deploy)

    c = sub.add_parser("check", help="preflight: inventory groups, every node reachable, OS facts")
    add_run_args(c, tags=False)
    c.set_defaults(func=_check)

    v = sub.add_parser("validate", help="validate a deployed cluster: GPUs, NCCL, all-reduce, storage, inference")
    add_run_args(v, tags=False)
    v.add_argument("--allreduce-mb", type=_positive_mb, default=None,
                   help="the all-reduce sweep's largest size (MiB, from 1 MiB doubling; default: 8192 on GPUs, "
                        "16 on CPU)")
    v.add_argument("--allreduce-busbw-min", type=_busbw_min, default=None, metavar="auto|GBIT",
                   help="fail when the bus bandwidth at the largest size is below this (Gbit/s; default auto: 100 on "
                        "NCCL, 1 on gloo; 0: no floor)")
    v.set_defaults(func=_validate)


def add_run_args(p: argparse.ArgumentParser, *, tags: bool = True) -> None:
    add_inventory_arg(p)
    if tags:
        p.add_argument("--tags", help="only these tags (comma-separated), e.g. os,gpu")
        p.add_argument("--skip-tags", help="skip these tags")
        p.add_argument("--check", action="store_true", help="dry run: report what would change")
    p.add_argument("--limit", help="only these hosts or groups")
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE|@FILE",
                   help="extra variables (repeatable, later ones win): KEY=VALUE, or @FILE, a YAML or JSON mapping; "
                        "values are literal data, never templates, e.g. -e training_runtime_wheelhouse_src=/path")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _extra_vars_file(path: Path) -> dict[str, Any]:
    """A -e @FILE: a YAML (or JSON, which YAML reads) mapping. safe_load builds plain data, no tags run; every string
    in it then goes through run_playbook's `inert` like a KEY=VALUE value, so Jinja in it is never evaluated."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ShardstackError(f"cannot read extra-vars file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ShardstackError(f"extra-vars file {path} is not YAML or JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ShardstackError(f"extra-vars file {path} must hold a mapping of variable names to values")
    for key in data:
        if not isinstance(key, str) or not key.isidentifier():
            raise ShardstackError(f"extra-vars file {path}: variable name {key!r} is not an identifier")
    try:  # JSON's types only: YAML's dates, sets or binary have no literal form for Ansible
        json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise ShardstackError(f"extra-vars file {path}: {exc}", hint="quote dates and times as strings") from None
    return data


def parse_extra_vars(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if pair.startswith("@"):
            out.update(_extra_vars_file(Path(pair[1:])))
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ShardstackError(f"extra variable {pair!r} is not KEY=VALUE or @FILE")
        out[key] = value
    return out


def run_and_report(playbook: str, args: argparse.Namespace, title: str, *,
                   extravars: dict[str, Any] | None = None) -> RunResult:
    extravars = {**parse_extra_vars(getattr(args, "extra_vars", None) or []), **(extravars or {})}
    result = run_playbook(playbook, args.inventory, tags=getattr(args, "tags", None),
                          skip_tags=getattr(args, "skip_tags", None), limit=args.limit,
                          check=getattr(args, "check", False), extravars=extravars,
                          on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(summary_table(result, title))
    return result


def _deploy(args: argparse.Namespace) -> int:
    result = run_and_report("site.yml", args, "deploy" + (" --check" if args.check else ""))
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS


def _check(args: argparse.Namespace) -> int:
    cluster = load_cluster(args)
    problems = cluster.problems()
    for p in problems:
        console.print(f"[red]inventory:[/] {p}", highlight=False)
    unset = unset_production_variables(cluster)  # warnings only: the exit code stays the preflight's
    if args.json:
        result = run_playbook("playbooks/preflight.yml", cluster.path, limit=args.limit,
                              extravars=parse_extra_vars(args.extra_vars))
        print(json.dumps({**result.to_dict(), "warnings": [u.to_dict() for u in unset]}, indent=2))
    else:
        result = run_and_report("playbooks/preflight.yml", args, "check (preflight)")
        for line in warning_lines(unset):
            console.print(f"[yellow]warning:[/] {line}", highlight=False, markup=True)
    return EXIT_OK if result.success and not problems else EXIT_FAILED_HOSTS


def validate_tables(data: dict[str, Any]) -> list[Table]:
    tables = []
    nodes = Table(title="validate: nodes")
    for col in ("host", "accelerator", "GPUs / driver / torch", "NCCL config", "storage write", "storage read (peer)",
                "same bytes"):
        nodes.add_column(col)
    gpu, storage = data.get("validate_gpu") or {}, data.get("validate_storage") or {}
    for host in sorted(set(gpu) | set(storage)):
        g, s = gpu.get(host, {}), storage.get(host, {})
        nodes.add_row(host, str((g.get("accel") or {}).get("accelerator") or "-"), _gpu_cell(g),
                      "\n".join(g.get("nccl_conf") or []) or "-", _dd_rate(s.get("write", "")),
                      f"{_dd_rate(s.get('read', ''))} ({s.get('read_of', '')})",
                      str(s.get("peer_checksum_matches", "")))
    tables.append(nodes)
    if ar := data.get("validate_allreduce"):
        t = Table(title=f"validate: all-reduce, {ar['backend']} × {ar['world_size']} rank(s) on {ar['nodes']} node(s)")
        floor = f" (floor {ar['busbw_min_gbps']:g})" if ar.get("busbw_min_gbps") else ""
        for col in ("size", "time", "algbw", f"busbw{floor}", "sum correct"):
            t.add_column(col, justify="right")
        for row in ar.get("sweep") or [ar]:
            t.add_row(f"{row['bytes'] / 2**20:g} MiB", f"{row['seconds_min'] * 1e3:.2f} ms",
                      f"{row['algbw_gbps']:.2f} Gbit/s", f"{row['busbw_gbps']:.2f} Gbit/s", str(row["correct"]))
        tables.append(t)
    if inf := data.get("validate_inference"):
        t = Table(title="validate: inference")
        for col in ("backends /health", "through the load balancer", "seconds", "text"):
            t.add_column(col)
        t.add_row(" ".join(f"{h}={c}" for h, c in (inf.get("backends") or {}).items()), str(inf.get("status")),
                  f"{float(inf.get('seconds', -1)):.3f}", repr(str(inf.get("text", ""))[:60]))
        tables.append(t)
    return tables


def _positive_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want MiB > 0")
    return value


def _busbw_min(text: str) -> str:
    try:
        busbw_floor(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _gpu_cell(report: dict[str, Any]) -> str:
    facts = node_facts(report)
    if facts is None:
        return "no facts"
    if not facts.has_nvidia:
        return f"no NVIDIA hardware (CPU node), torch {facts.torch_version}"
    smi = facts.smi_output if facts.smi_rc == 0 else []
    cuda = "CUDA ok" if facts.cuda_available else "CUDA unusable" if facts.torch_cuda else "CPU build"
    dcgm = {None: "", 0: ", DCGM diag passed"}.get(facts.dcgm_rc, ", DCGM diag failed")
    return "\n".join([*smi] or [f"{len(facts.gpus)} NVIDIA GPU(s)"]) + (
        f"\ndriver {facts.driver_version or 'not loaded'}, torch {facts.torch_version} ({cuda}){dcgm}")


def _dd_rate(line: str) -> str:
    # dd's summary: "33554432 bytes (34 MB, 32 MiB) copied, 0.05 s, 671 MB/s"
    return line.rsplit(",", 1)[-1].strip() if "copied" in line else line


def _validate(args: argparse.Namespace) -> int:
    result, findings = run_validate(load_cluster(args), allreduce_mb=args.allreduce_mb,
                                    allreduce_busbw_min=args.allreduce_busbw_min, limit=args.limit,
                                    extravars=parse_extra_vars(args.extra_vars),
                                    on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps({**result.to_dict(), "findings": findings}, indent=2))
    else:
        console.print(summary_table(result, "validate"))
        for t in validate_tables(result.data):
            console.print(t)
        for f in findings:
            console.print(f"[red]FAILED[/] {f}", highlight=False)
    return EXIT_OK if result.success and not findings else EXIT_FAILED_HOSTS
