"""`shardstack demo`: the lab end to end — lab up (3 nodes), site.yml, the pretrained Llama (built here once and
cached: `shardstack pretrained`) copied to shared storage, a 2-node ZeRO-3 job that fine-tunes it, export, the
inference tier behind the load balancer, a completion, validate, and a second deploy that must change nothing."""

from __future__ import annotations

import argparse
import json
import time

from rich.table import Table

from shardstack.build import pretrained
from shardstack.build.wheelhouse import build
from shardstack.cli.deploy import run_and_report, validate_tables
from shardstack.cli.inventory import LAB_INVENTORY
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, Progress, console, summary_table
from shardstack.errors import ShardstackError
from shardstack.lab import lab
from shardstack.ops import endpoint, serve, storage, train
from shardstack.ops.demo import demo_job
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import JobStatus
from shardstack.ops.runner import project_dir
from shardstack.ops.validate import run_validate

PROMPT = "Return the"  # how many docstrings of the corpus begin


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="lab up (3 nodes) → site.yml → train → export → serve → validate → re-deploy")
    d.add_argument("--name", default="demo", help="lab name (default demo)")
    d.add_argument("--steps", type=int, default=60, help="fine-tuning steps of the demo job (default 60)")
    d.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    d.add_argument("--json", action="store_true",
                   help="print the outcome (phases with seconds, the completion, the error if any) as JSON on stdout; "
                        "progress and tables stay on stderr")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    phases: list[tuple[str, float]] = []
    inventory = LAB_INVENTORY  # the lab this command brings up writes it here
    cluster = Cluster.load(inventory)  # read on first use, once the lab wrote it

    def phase(name: str, started: float) -> None:
        phases.append((name, time.monotonic() - started))
        console.print(f"[bold green]✓[/] {name}: {phases[-1][1]:.1f}s", highlight=False)

    t0 = time.monotonic()
    if args.name in lab.st.list_labs():
        console.print(f"lab {args.name} already up; reusing it")
    else:
        lab.up(args.name, 3, inventory, Progress())
    phase("lab up (3 nodes)", t0)
    ns = argparse.Namespace(inventory=inventory, tags=None, skip_tags=None, limit=None, check=False, json=False)
    completion = None
    error: str | None = None
    try:
        # One wheelhouse for every run of the demo, so the second deploy compares like with like.
        t = time.monotonic()
        wh = build(project_dir(), log=lambda m: console.print(m, highlight=False))
        pinned = {"training_runtime_wheelhouse_src": str(wh.path)}
        phase(f"wheelhouse ({'built' if wh.built else 'cached'}, {wh.bytes / 2**20:.0f} MiB)", t)

        first = run_and_report("site.yml", ns, "site.yml, first run", extravars=pinned)
        phases.append(("site.yml", first.seconds))
        if not first.success:
            raise ShardstackError("site.yml failed on the lab; see the table above", exit_code=EXIT_FAILED_HOSTS)

        t = time.monotonic()
        cached = (pretrained.model_dir() / pretrained.RECORD).is_file()
        if not cached:
            console.print(f"building the pretrained model once into {pretrained.model_dir()} (a few minutes)")
        model = pretrained.build(echo=lambda m: console.print(m, highlight=False))
        init_from = storage.place_model(cluster, model)
        phase(f"pretrained {model.name} ({'cached' if cached else 'built'}) → {init_from}", t)

        t = time.monotonic()
        job = demo_job(args.steps, cluster.shared_dir, init_from=init_from)
        # A rerun with another --steps continues the demo's own job (its own checkpoint.dir): a config change it means.
        sub = train.submit(job, "demo", cluster, nodes=2, allow_config_change=True, prepare_demo_data=True,
                           on_event=LiveProgress())
        if not sub.success:
            console.print(summary_table(sub, "train submit demo"))
            raise ShardstackError("train submit failed", exit_code=EXIT_FAILED_HOSTS)

        def show(st: JobStatus) -> None:
            last = st.last_step
            console.print(f"  job demo: {st.state}" + (f", step {last['step']}/{args.steps} loss {last['loss']:.3f}"
                                                       f" {last['tokens_per_second']:.0f} tok/s" if last else ""),
                          highlight=False)

        st = train.wait_job("demo", cluster, timeout=max(600, args.steps * 5), on_status=show)
        if st.state != "finished":
            raise ShardstackError(f"the demo job ended {st.state}", hint="shardstack train logs demo",
                                  exit_code=EXIT_FAILED_HOSTS)
        phase(f"train: fine-tune {model.name}, 2 nodes, ZeRO-3, {args.steps} steps", t)

        t = time.monotonic()
        exp = storage.export_current(cluster, job["checkpoint"]["dir"], "demo")
        phase(f"export → {exp.current}", t)

        t = time.monotonic()
        ro = serve.rollout(cluster, extravars=pinned, on_event=LiveProgress())
        if not ro.success:
            console.print(summary_table(ro, "serve rollout"))
            raise ShardstackError("serve rollout failed", exit_code=EXIT_FAILED_HOSTS)
        phase("serve rollout (inference nodes load the model)", t)

        t = time.monotonic()
        # Greedy: the fine-tuned model continues a corpus-style sentence with words of the corpus.
        completion = endpoint.complete(endpoint.endpoint(cluster), PROMPT, max_tokens=48, temperature=0.0)
        if completion.status != 200:
            raise ShardstackError(f"completion through the load balancer answered {completion.status}: "
                                  f"{completion.body}", exit_code=EXIT_FAILED_HOSTS)
        phase("a completion through the load balancer (HTTPS, cluster CA)", t)

        t = time.monotonic()
        val, findings = run_validate(cluster)
        for table in validate_tables(val.data):
            console.print(table)
        if findings or not val.success:
            raise ShardstackError("validate failed: " + "; ".join(findings or ["see the artifacts"]),
                                  exit_code=EXIT_FAILED_HOSTS)
        phase("validate", t)

        again = run_and_report("site.yml", ns, "site.yml, second run (must change nothing)", extravars=pinned)
        phases.append((f"site.yml again ({again.changed} changed)", again.seconds))
        if not again.success or again.changed:
            raise ShardstackError(f"second deploy was not clean: {again.changed} changed, {again.failed} failed",
                                  exit_code=EXIT_FAILED_HOSTS)
    except ShardstackError as exc:
        error = str(exc)
        raise
    finally:
        if not args.keep:
            t = time.monotonic()
            lab.down(args.name, Progress())
            phases.append(("lab down", time.monotonic() - t))
        table = Table(title="demo phases")
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        for name, secs in phases:
            table.add_row(name, f"{secs:.1f}")
        console.print(table)
        if args.json:  # also when a phase failed: which one, and how long the others took
            print(json.dumps({"name": args.name, "ok": error is None, "error": error,
                              "phases": [{"phase": n, "seconds": round(s, 1)} for n, s in phases],
                              "completion": None if completion is None else {
                                  "prompt": PROMPT, "text": completion.text, "seconds": completion.seconds}},
                             indent=2))
    if completion and not args.json:
        console.print(f"[bold]completion from the trained model[/] ({completion.seconds * 1e3:.0f} ms): "
                      f"{PROMPT!r} → {completion.text!r}", highlight=False)
    return EXIT_OK
