"""Deploy time of site.yml on 1, 2 and 4 lab nodes: first run from bare nodes and an idempotent re-run.

    python bench/deploy_scale.py [--nodes 1 2 4] [--json out.json]

Each size gets a fresh lab (prefix `eb`), the same prebuilt wheelhouse (its one-off build is not deploy time),
and the lab's group layout (inventory.group_layout). Prints a table; the lab is taken down after each size.
Needs root (the lab). On the 2-core CI host the first run is dominated by installing torch into each node's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from shardstack.cli.output import Progress
from shardstack.lab import lab
from shardstack.ops.runner import project_dir, run_playbook
from shardstack.ops.wheelhouse import build


def deploy_times(nodes: int, wheelhouse: Path) -> dict:
    name = f"eb{nodes}"
    if name in lab.st.list_labs():
        lab.down(name, Progress())
    with tempfile.TemporaryDirectory() as tmp:
        inventory = Path(tmp) / "hosts.yml"
        t = time.monotonic()
        lab.up(name, nodes, inventory, Progress())
        boot = time.monotonic() - t
        try:
            extravars = {"training_runtime_wheelhouse_src": str(wheelhouse)}
            first = run_playbook("site.yml", inventory, extravars=extravars)
            again = run_playbook("site.yml", inventory, extravars=extravars)
        finally:
            lab.down(name, Progress())
    if not (first.success and again.success):
        failed = {h: (r.failed_task, r.message) for res in (first, again) for h, r in res.hosts.items()
                  if not r.success}
        raise SystemExit(f"{nodes} node(s): site.yml failed: {failed}")
    return {"nodes": nodes, "lab_up_s": round(boot, 1), "first_s": round(first.seconds, 1),
            "first_changed": first.changed, "rerun_s": round(again.seconds, 1), "rerun_changed": again.changed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the lab needs root")
    wh = build(project_dir(), log=lambda m: print(m, file=sys.stderr))
    rows = [deploy_times(n, wh.path) for n in args.nodes]
    load = os.getloadavg()[0]
    print(f"\nsite.yml deploy time on lab nodes ({os.cpu_count()} host cores, load {load:.1f}, "
          f"{platform.node()}; wheelhouse {wh.bytes / 2**20:.0f} MiB prebuilt)")
    print(f"{'nodes':>5} | {'first run (s)':>13} | {'changed':>7} | {'re-run (s)':>10} | {'changed':>7}")
    print("-" * 56)
    for r in rows:
        print(f"{r['nodes']:>5} | {r['first_s']:>13.1f} | {r['first_changed']:>7} | {r['rerun_s']:>10.1f} | "
              f"{r['rerun_changed']:>7}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "host_cores": os.cpu_count(), "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
