"""`shardstack demo` on a lab that is up: the wheelhouse, site.yml, the pretrained Llama (built here once and cached)
copied to shared storage, a 2-node ZeRO-3 job that fine-tunes it, export, the inference tier behind the load balancer,
a completion, validate, and a second deploy that must change nothing. The lab itself is the CLI's to bring up and
down (ops does not drive the lab); what is shown while it runs, the caller's hooks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardstack.build import pretrained
from shardstack.build.wheelhouse import build
from shardstack.errors import ShardstackError
from shardstack.ops import endpoint, serve, storage, train
from shardstack.ops.endpoint import Completion
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import JobStatus
from shardstack.ops.runner import RunnerEvent, RunResult, project_dir, run_playbook
from shardstack.ops.validate import run_validate

PROMPT = "Return the"  # how many docstrings of the corpus begin
_FAILED = 1  # the CLI's EXIT_FAILED_HOSTS: a step on the lab failed, not the user's input (ops does not import cli)


def demo_job(steps: int, shared_dir: str, name: str = "demo", *, init_from: str | None = None) -> dict[str, Any]:
    """The demo's job (also the e2e's): ZeRO stage 3 (FSDP2) across 2 nodes on CPU, on the shipped corpus. With
    `init_from` (a Hugging Face directory every train node sees, e.g. the pretrained model `storage.place_model` put
    on shared storage) it fine-tunes that model, the corpus prepared with its tokenizer; without, it trains a tiny
    byte-level GPT from scratch."""
    from shardstack.train.config import config_from_dict

    if init_from is None:
        model: dict[str, Any] = {"size": "tiny"}
        data: dict[str, Any] = {"path": f"{shared_dir}/data/corpus"}
        lr, warmup = 3e-3, min(20, steps // 10)
    else:
        model = {"init_from": init_from}
        data = {"path": f"{shared_dir}/data/corpus-{Path(init_from).name}", "tokenizer": init_from}
        # A model pretrained on this corpus: a tenth of its peak learning rate, a short warm-up.
        lr, warmup = 3e-4, min(10, steps // 10)
    cfg = {
        "model": model,
        "data": data,
        "engine": {"stage": 3, "device": "auto"},
        "optimizer": {"lr": lr},
        "schedule": {"warmup_steps": warmup, "total_steps": steps},
        "batch": {"global_batch": 8, "micro_batch": 4},
        "checkpoint": {"dir": f"{shared_dir}/checkpoints/{name}", "interval": max(10, steps // 6), "keep": 2},
        "metrics": {"port": 9400, "log_every": 10},
    }
    return config_from_dict(cfg).to_dict()


@dataclass
class DemoResult:
    """The demo's outcome, filled in as it goes: a caller that catches the error still has the phases that ran."""

    name: str
    phases: list[tuple[str, float]] = field(default_factory=list)  # (phase, seconds)
    completion: Completion | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.error is None, "error": self.error,
                "phases": [{"phase": n, "seconds": round(s, 1)} for n, s in self.phases],
                "completion": None if self.completion is None else {
                    "prompt": PROMPT, "text": self.completion.text, "seconds": self.completion.seconds}}


def _silent(*_: Any) -> None:
    pass


@dataclass
class DemoHooks:
    """What the caller shows while the demo runs; silent by default."""

    echo: Callable[[str], None] = _silent  # a line of progress
    phase: Callable[[str, float], None] = _silent  # a phase done, with its seconds
    events: Callable[[], Callable[[RunnerEvent], None] | None] = lambda: None  # a live view for one playbook run
    ran: Callable[[RunResult, str], None] = _silent  # a run to show (site.yml's; a failed one's), with its title
    validated: Callable[[dict[str, Any]], None] = _silent  # validate.yml's published measurements


def run(cluster: Cluster, steps: int, hooks: DemoHooks, result: DemoResult) -> DemoResult:
    """The demo's phases on the lab `cluster` describes, recorded in `result`; the first that fails raises (its
    message also in result.error)."""

    def done(name: str, started: float) -> None:
        result.phases.append((name, time.monotonic() - started))
        hooks.phase(name, result.phases[-1][1])

    def deploy(title: str, pinned: dict[str, Any]) -> RunResult:
        res = run_playbook("site.yml", cluster.path, extravars=pinned, on_event=hooks.events())
        hooks.ran(res, title)
        return res

    try:
        # One wheelhouse for every run of the demo, so the second deploy compares like with like.
        t = time.monotonic()
        wh = build(project_dir(), log=hooks.echo)
        pinned = {"training_runtime_wheelhouse_src": str(wh.path)}
        done(f"wheelhouse ({'built' if wh.built else 'cached'}, {wh.bytes / 2**20:.0f} MiB)", t)

        first = deploy("site.yml, first run", pinned)
        result.phases.append(("site.yml", first.seconds))
        if not first.success:
            raise ShardstackError("site.yml failed on the lab; see the table above", exit_code=_FAILED)

        t = time.monotonic()
        cached = (pretrained.model_dir() / pretrained.RECORD).is_file()
        if not cached:
            hooks.echo(f"building the pretrained model once into {pretrained.model_dir()} (a few minutes)")
        model = pretrained.build(echo=hooks.echo)
        init_from = storage.place_model(cluster, model)
        done(f"pretrained {model.name} ({'cached' if cached else 'built'}) → {init_from}", t)

        t = time.monotonic()
        job = demo_job(steps, cluster.shared_dir, init_from=init_from)
        # A rerun with another --steps continues the demo's own job (its own checkpoint.dir): a config change it means.
        sub = train.submit(job, "demo", cluster, nodes=2, allow_config_change=True, prepare_demo_data=True,
                           on_event=hooks.events())
        if not sub.success:
            hooks.ran(sub, "train submit demo")
            raise ShardstackError("train submit failed", exit_code=_FAILED)

        def show(st: JobStatus) -> None:
            last = st.last_step
            hooks.echo(f"  job demo: {st.state}" + (f", step {last['step']}/{steps} loss {last['loss']:.3f}"
                                                    f" {last['tokens_per_second']:.0f} tok/s" if last else ""))

        st = train.wait_job("demo", cluster, timeout=max(600, steps * 5), on_status=show)
        if st.state != "finished":
            raise ShardstackError(f"the demo job ended {st.state}", hint="shardstack train logs demo",
                                  exit_code=_FAILED)
        done(f"train: fine-tune {model.name}, 2 nodes, ZeRO-3, {steps} steps", t)

        t = time.monotonic()
        exp = storage.export_current(cluster, job["checkpoint"]["dir"], "demo")
        done(f"export → {exp.current}", t)

        t = time.monotonic()
        ro = serve.rollout(cluster, extravars=pinned, on_event=hooks.events())
        if not ro.success:
            hooks.ran(ro, "serve rollout")
            raise ShardstackError("serve rollout failed", exit_code=_FAILED)
        done("serve rollout (inference nodes load the model)", t)

        t = time.monotonic()
        # Greedy: the fine-tuned model continues a corpus-style sentence with words of the corpus.
        result.completion = endpoint.complete(endpoint.endpoint(cluster), PROMPT, max_tokens=48, temperature=0.0)
        if result.completion.status != 200:
            raise ShardstackError(f"completion through the load balancer answered {result.completion.status}: "
                                  f"{result.completion.body}", exit_code=_FAILED)
        done("a completion through the load balancer (HTTPS, cluster CA)", t)

        t = time.monotonic()
        val, findings = run_validate(cluster)
        hooks.validated(val.data)
        if findings or not val.success:
            raise ShardstackError("validate failed: " + "; ".join(findings or ["see the artifacts"]),
                                  exit_code=_FAILED)
        done("validate", t)

        again = deploy("site.yml, second run (must change nothing)", pinned)
        result.phases.append((f"site.yml again ({again.changed} changed)", again.seconds))
        if not again.success or again.changed:
            raise ShardstackError(f"second deploy was not clean: {again.changed} changed, {again.failed} failed",
                                  exit_code=_FAILED)
    except ShardstackError as exc:
        result.error = str(exc)
        raise
    return result
