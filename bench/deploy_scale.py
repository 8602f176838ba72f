"""Deploy time of site.yml on 1, 2 and 4 lab nodes: first run from bare nodes and an idempotent re-run, each with its
slowest tasks and what the run is made of.

    python bench/deploy_scale.py [--nodes 1 2 4] [--strategy linear mitogen_linear] [--top 10] [--json out.json]

Each size gets a fresh lab (prefix `eb`), the same prebuilt wheelhouse (its one-off build is not deploy time), and
the lab's group layout (inventory.group_layout); with --strategy, each size once per Ansible strategy named
(ANSIBLE_STRATEGY; by default the one ansible.cfg names), one after the other. Prints a table, then per size and run
the --top tasks by wall time (first host's start to last host's end, from ansible-runner's per-host events; a task
included in several plays counts once per play, a handler once per flush), and the run's make-up: tasks, tasks every
host skipped, host results, and the results by action (a loop's items each count; a template or copy that changes
nothing is two module executions on the node, a stat and a file) and its CPU (class Cpu). The lab is taken down
after each size. Needs root (the lab). On the 2-core CI host the first run is dominated by installing torch into
each node's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

from shardstack.build.wheelhouse import build
from shardstack.cli.output import Progress
from shardstack.lab import lab
from shardstack.ops.runner import project_dir, run_playbook


class Profile:
    """Wall time per task from ansible-runner's per-host result events (what ansible.posix.profile_tasks prints,
    without that collection)."""

    RESULTS = ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_on_unreachable")
    STARTS = ("playbook_on_task_start", "playbook_on_handler_task_start")

    def __init__(self) -> None:
        # (task uuid, its nth start) -> [name, first start, last end]: a handler notified before two flushes runs
        # twice under one uuid, and one span over both would count the tasks between them as its own time.
        self._spans: dict[tuple[str, int], list] = {}
        self._starts: Counter = Counter()  # task uuid -> times started so far
        self._outcomes: dict[str, Counter] = defaultdict(Counter)  # task uuid -> host results by event
        self.actions: Counter = Counter()  # action -> results that ran (ok or changed; a loop's items apart)

    def __call__(self, event: dict) -> None:
        data = event.get("event_data", {})
        kind = event.get("event")
        if kind in self.STARTS:
            self._starts[data.get("task_uuid", "")] += 1
        if kind in ("runner_item_on_ok", "runner_on_ok") and not data.get("res", {}).get("results"):
            self.actions[data.get("task_action", "?")] += 1
        if kind in self.RESULTS:
            self._outcomes[data.get("task_uuid", "")][kind] += 1
        if kind not in self.RESULTS or not data.get("start") or not data.get("end"):
            return
        start, end = datetime.fromisoformat(data["start"]), datetime.fromisoformat(data["end"])
        name = f"{data['role']} : {data.get('task', '')}" if data.get("role") else data.get("task", "")
        uuid = data.get("task_uuid", name)
        span = self._spans.setdefault((uuid, self._starts[uuid]), [name, start, end])
        span[1], span[2] = min(span[1], start), max(span[2], end)

    def makeup(self) -> dict:
        """Tasks, the tasks every host skipped (pure per-task cost), host results, results by action."""
        results = sum(self._outcomes.values(), Counter())
        return {"tasks": len(self._outcomes),
                "all_skipped": sum(1 for c in self._outcomes.values() if set(c) == {"runner_on_skipped"}),
                "ok_results": results["runner_on_ok"], "skipped_results": results["runner_on_skipped"],
                "actions": dict(self.actions.most_common())}

    def top(self, n: int) -> list[tuple[str, float]]:
        walls: dict[str, float] = defaultdict(float)
        for name, start, end in self._spans.values():
            walls[name] += (end - start).total_seconds()
        return sorted(walls.items(), key=lambda kv: -kv[1])[:n]


class Cpu:
    """CPU seconds one run cost, to tell work from waiting: the whole machine's busy time (/proc/stat) against its
    cores × wall, the lab nodes' (each node's cgroup2 cpu.stat: its sshd, the modules, what they start) and the
    controller side's (this process and the processes it reaped: ansible-playbook, its workers, the ssh clients; not
    the ssh connection masters, which outlive the run detached)."""

    def __init__(self, cgroups: list[Path]) -> None:
        self.stats = [c / "cpu.stat" for c in cgroups]  # cgroup2 directories

    def _sample(self) -> tuple[float, float, float, float]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        busy, total = (sum(fields) - fields[3] - fields[4]) / tick, sum(fields) / tick  # less idle and iowait
        nodes = sum(int(p.read_text().split()[1]) / 1e6 for p in self.stats if p.exists())  # usage_usec
        own = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return busy, total, nodes, sum(r.ru_utime + r.ru_stime for r in own)

    def __enter__(self) -> Cpu:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total, nodes, controller = (b - a for a, b in zip(self.start, self._sample(), strict=True))
        self.result = {"busy_cpu_s": round(busy, 1), "busy_share": round(busy / total, 2) if total else 0.0,
                       "nodes_cpu_s": round(nodes, 1), "controller_cpu_s": round(controller, 1)}


def deploy_times(nodes: int, wheelhouse: Path, top: int, strategy: str | None = None) -> dict:
    name = f"eb{nodes}"
    if name in lab.st.list_labs():
        lab.down(name, Progress())
    with tempfile.TemporaryDirectory() as tmp:
        inventory = Path(tmp) / "hosts.yml"
        t = time.monotonic()
        lab.up(name, nodes, inventory, Progress())
        boot = time.monotonic() - t
        old = os.environ.get("ANSIBLE_STRATEGY")
        if strategy:
            os.environ["ANSIBLE_STRATEGY"] = strategy  # ansible-runner passes the environment on
        try:
            extravars = {"training_runtime_wheelhouse_src": str(wheelhouse)}
            first_profile, again_profile = Profile(), Profile()
            cgroups = [lab.st.cgroup_paths(name, n.name)[-1] for n in lab.st.LabState.load(name).nodes]
            with Cpu(cgroups) as first_cpu:
                first = run_playbook("site.yml", inventory, extravars=extravars, on_event=first_profile)
            with Cpu(cgroups) as again_cpu:
                again = run_playbook("site.yml", inventory, extravars=extravars, on_event=again_profile)
        finally:
            os.environ.pop("ANSIBLE_STRATEGY", None)
            if old is not None:
                os.environ["ANSIBLE_STRATEGY"] = old
            lab.down(name, Progress())
    if not (first.success and again.success):
        failed = {h: (r.failed_task, r.message) for res in (first, again) for h, r in res.hosts.items()
                  if not r.success}
        if not failed:  # ansible-playbook stopped before any host ran (a bad --strategy, a syntax error)
            bad = first if not first.success else again
            failed = f"rc {bad.rc} before any host ran; ansible's output: {bad.artifact_dir}/stdout"
        raise SystemExit(f"{nodes} node(s): site.yml failed: {failed}")
    return {"nodes": nodes, "strategy": strategy or configured_strategy(), "lab_up_s": round(boot, 1),
            "first_s": round(first.seconds, 1),
            "first_changed": first.changed, "rerun_s": round(again.seconds, 1), "rerun_changed": again.changed,
            "first_top": first_profile.top(top), "rerun_top": again_profile.top(top),
            "first_makeup": first_profile.makeup(), "rerun_makeup": again_profile.makeup(),
            "first_cpu": first_cpu.result, "rerun_cpu": again_cpu.result}


def configured_strategy() -> str:
    """The strategy a run gets without --strategy: $ANSIBLE_STRATEGY, else ansible.cfg's, else Ansible's default."""
    import configparser

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(project_dir() / "ansible.cfg")
    return os.environ.get("ANSIBLE_STRATEGY") or cfg.get("defaults", "strategy", fallback="linear")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strategy", nargs="+", default=[None], metavar="NAME",
                   help="Ansible strategies to compare, each on a fresh lab per size (default: ansible.cfg's)")
    p.add_argument("--top", type=int, default=10, help="slowest tasks to list per run (default 10)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the lab needs root")
    wh = build(project_dir(), log=lambda m: print(m, file=sys.stderr))
    rows = [deploy_times(n, wh.path, args.top, strategy) for n in args.nodes for strategy in args.strategy]
    load = os.getloadavg()[0]
    print(f"\nsite.yml deploy time on lab nodes ({os.cpu_count()} host cores, load {load:.1f}, "
          f"{platform.node()}; wheelhouse {wh.bytes / 2**20:.0f} MiB prebuilt)")
    print(f"{'nodes':>5} | {'strategy':<14} | {'first run (s)':>13} | {'changed':>7} | {'re-run (s)':>10} | "
          f"{'changed':>7}")
    print("-" * 73)
    for r in rows:
        print(f"{r['nodes']:>5} | {r['strategy']:<14} | {r['first_s']:>13.1f} | {r['first_changed']:>7} | "
              f"{r['rerun_s']:>10.1f} | {r['rerun_changed']:>7}")
    for r in rows:
        for run in ("first", "rerun"):
            print(f"\n{r['nodes']} node(s), {r['strategy']}, {'first run' if run == 'first' else 're-run'}: "
                  "slowest tasks (wall s)")
            for name, wall in r[f"{run}_top"]:
                print(f"  {wall:7.1f}  {name}")
            m = r[f"{run}_makeup"]
            print(f"  {m['tasks']} tasks ({m['all_skipped']} skipped on every host); {m['ok_results']} ok and "
                  f"{m['skipped_results']} skipped host results; results by action:")
            print("  " + ", ".join(f"{mod.removeprefix('ansible.builtin.')} {n}" for mod, n in m["actions"].items()))
            c = r[f"{run}_cpu"]
            print(f"  CPU: {c['busy_cpu_s']} s busy over the machine's cores ({c['busy_share']:.0%} of cores × wall); "
                  f"lab nodes {c['nodes_cpu_s']} s, controller side {c['controller_cpu_s']} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "host_cores": os.cpu_count(), "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
