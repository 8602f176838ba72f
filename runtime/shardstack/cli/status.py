"""`shardstack status [--json] [--watch [SECONDS]]`: the cluster in one table (docs/operations.md, "Status"); exit 1
when a node is DOWN or a critical alert fires, so scripts and cron can act on it."""

from __future__ import annotations

import argparse
import json
import time

from rich.live import Live
from rich.table import Table

from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, console
from shardstack.ops import cordon, replicas
from shardstack.ops import status as status_ops


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="nodes, failed units, training, inference backends and replicas, the "
                                      "autoscaler and alerts in one table")
    add_inventory_arg(p)
    p.add_argument("--json", action="store_true", help="the same data as one JSON document")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 5) until interrupted")
    p.set_defaults(func=_status)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def table(st: status_ops.Status) -> Table:
    t = Table(title="shardstack status", show_lines=False)
    for col in ("kind", "name", "state", "detail"):
        t.add_column(col)
    for n in st.nodes:
        state = {True: "[green]up[/]", False: "[red]DOWN[/]", None: "?"}[n["up"]]
        if n["cordoned"]:
            state += f" [yellow]{ {'cordon': 'cordoned', 'drain': 'drained'}.get(n['cordoned'], n['cordoned'])}[/]"
        t.add_row("node", n["node"], state, ", ".join(n["groups"] + n["gpu_alerts"]))
    for u in st.failed_units or []:
        t.add_row("unit", f"{u['node']}: {u['unit']}", "[red]failed[/]", "")
    for tr in st.training:
        detail = (f"step {tr.get('step', 0):.0f}/{tr.get('end_step', 0):.0f}, loss {tr.get('loss', float('nan')):.4f}, "
                  f"{tr.get('tokens_per_second', 0):.0f} tokens/s, last checkpoint "
                  f"{_num(tr.get('last_checkpoint_step'), '{:.0f}')}, ETA {_duration(tr.get('eta_seconds'))}")
        t.add_row("training", tr["node"], "reporting", detail)
    for b in st.backends:
        colour = "green" if b["status"] == "UP" else "yellow" if b["status"] == "DRAIN" else "red"
        detail = (f"{b.get('engine') or '-'}: {_num(b.get('requests_per_second'), '{:.1f}')} req/s, p99 "
                  f"{_num(b.get('p99_seconds'), '{:.3f}')} s, {_num(b.get('engine_waiting'), '{:.0f}')} waiting"
                  + (f", KV cache {b['kv_cache_usage']:.0%}" if b.get("kv_cache_usage") is not None else "")
                  + f"; {b['sessions']} sessions, {b['queued']} queued at the edge, {b['sessions_total']} since "
                    f"start, check {b['check'] or '-'}")
        t.add_row("backend", b["server"], f"[{colour}]{b['status']}[/]", detail)
    for r in st.replicas or []:
        t.add_row("replica", f"job {r['job_id']}", r["state"].lower(), f"on {r['node']}" if r["node"] else "")
    if a := st.autoscaler:
        ago = f", decided {_duration(time.time() - a['last_decision'])} ago" if "last_decision" in a else ""
        t.add_row("autoscaler", a["node"], "[yellow]saturated[/]" if a.get("saturated") else "ok",
                  f"{a.get('current', '-')} replica(s), wants {a.get('wanted', '-')}; {a.get('min_replicas', '-')}.."
                  f"{a.get('max_replicas', '-')}, floor {a.get('floor', '-')}{ago}")
        for c in a["changes"]:
            t.add_row("scaled", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["time"])),
                      f"{c['action']} {c['from']}→{c['to']}", c["reason"])
    for a in st.alerts:
        colour = "red" if a["severity"] == "critical" else "yellow"
        t.add_row("alert", a["name"], f"[{colour}]{a['severity']}[/]", f"{a['node']} {a['summary']}".strip())
    for note in st.notes:
        t.add_row("note", "", "", note)
    return t


def _status(args: argparse.Namespace) -> int:
    cluster = load_cluster(args)
    prometheus, haproxy = status_ops.sources(cluster)
    jobs = None
    if cluster.scheduler == "slurm" and replicas.scheduled(cluster):
        slurm = replicas.ClusterSlurm(cluster)

        def jobs() -> list[replicas.ReplicaJob]:
            return replicas.replicas(slurm)

    def snapshot() -> status_ops.Status:
        return status_ops.collect(cluster.groups, cordon.load(cluster), prometheus, haproxy, jobs)

    if args.json:
        st = snapshot()
        print(json.dumps(st.to_dict(), indent=2))
        return EXIT_FAILED_HOSTS if st.problems() else EXIT_OK
    if not args.watch:
        st = snapshot()
        console.print(table(st))
        for problem in st.problems():
            console.print(f"[red]unhealthy:[/] {problem}", highlight=False)
        return EXIT_FAILED_HOSTS if st.problems() else EXIT_OK
    with Live(table(snapshot()), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(args.watch)
            live.update(table(snapshot()), refresh=True)
