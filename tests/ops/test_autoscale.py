"""The autoscaler's decision (ops/autoscale.py) on a clock the test moves: scale-out under load, hysteresis, the
cooldowns, the maximum, scale to and from zero, and a schedule floor."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from datetime import time as clock
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from ansible_vars import RoleEval
from prometheus_client.parser import text_string_to_metric_families
from shardstack.errors import ShardstackError
from shardstack.ops import status as status_ops
from shardstack.ops.autoscale import (
    AutoscaleConfig,
    Policy,
    ScheduleFloor,
    Signals,
    State,
    decide,
    evaluate,
    read_signals,
    run,
    write_metrics,
)
from shardstack.ops.replicas import LocalSlurm
from shardstack.ops.status import prom_query

NOON = datetime(2026, 12, 3, 12, 0)
NIGHT = datetime(2026, 12, 3, 2, 30)
POLICY = Policy(min_replicas=1, max_replicas=3, target_load=8, max_waiting=4, max_ttft_p95=2.0,
                scale_down_ratio=0.5, up_cooldown=60, down_cooldown=300)


def _at(replicas: int, running: float, waiting: float = 0, ttft: float | None = 0.1, refused: float = 0,
        since: float = 1000, now: datetime = NOON, policy: Policy = POLICY):
    return decide(policy, Signals(replicas, running, waiting, ttft, refused), now=now, since_change=since)


def test_load_above_target_adds_what_the_load_needs() -> None:
    d = _at(1, running=8, waiting=12)  # 20 requests, 8 per replica: 3 replicas
    assert (d.action, d.replicas, d.saturated) == ("up", 3, True)
    assert "load 20.0/replica > 8" in d.reason and "waiting 12.0/replica > 4" in d.reason
    assert d.line().startswith("autoscale: up 1→3 (saturated: ") and "running=8 waiting=12" in d.line()


@pytest.mark.parametrize(("signals", "why"), [
    ({"running": 4, "ttft": 3.5}, "TTFT p95 3.50s > 2s"),
    ({"running": 4, "refused": 0.5}, "0.5 refused/s"),
])
def test_latency_or_refusals_alone_add_one_replica(signals: dict, why: str) -> None:
    d = _at(1, **signals)
    assert (d.action, d.replicas) == ("up", 2) and why in d.reason


def test_at_max_and_saturated_holds_and_says_so() -> None:
    d = _at(3, running=24, waiting=30)
    assert (d.action, d.replicas, d.saturated) == ("hold", 3, True)
    assert d.reason.startswith("at max_replicas 3 and saturated")


def test_the_scale_up_cooldown() -> None:
    assert _at(1, running=20, since=30).action == "hold"
    assert "scale-up cooldown (30s of 60s)" in _at(1, running=20, since=30).reason
    assert _at(1, running=20, since=61).action == "up"


def test_hysteresis_between_adding_and_removing() -> None:
    # 2 replicas, 7 requests: within target, but on one replica 7 ≥ 0.5 × 8: keep both (no flapping at the edge).
    assert (_at(2, running=7).action, _at(2, running=7).reason) == ("hold", "within target")
    # 3 requests on one replica would be < 4: remove one, after the longer cooldown.
    assert _at(2, running=3, since=200).action == "hold"
    d = _at(2, running=3, since=301)
    assert (d.action, d.replicas) == ("down", 1) and "idle" in d.reason
    assert _at(2, running=3, waiting=1, since=301).action == "hold"  # something waits: not idle
    assert _at(1, running=0).reason == "at the floor of 1"


def test_scale_to_zero_and_back() -> None:
    zero = Policy(min_replicas=0, max_replicas=2, down_cooldown=0)
    assert (_at(1, running=0, policy=zero).action, _at(1, running=0, policy=zero).replicas) == ("down", 0)
    assert _at(1, running=1, policy=zero).action == "hold"  # one request in flight keeps the last replica
    # At zero nothing reports load; a refused request (HAProxy has no backend) brings one back.
    assert _at(0, running=0, ttft=None, policy=zero).action == "hold"
    back = _at(0, running=0, ttft=None, refused=0.2, policy=zero)
    assert (back.action, back.replicas) == ("up", 1)


def test_a_schedule_floor_holds_while_in_force() -> None:
    policy = Policy(min_replicas=1, max_replicas=3, down_cooldown=0,
                    floors=(ScheduleFloor.parse("08:00-20:00=2"), ScheduleFloor(clock(23), clock(1), 3)))
    assert _at(1, running=0, policy=policy).action == "up"  # noon: the day's floor of 2
    assert _at(1, running=0, policy=policy).reason == "below the floor of 2"
    assert _at(2, running=0, policy=policy).action == "hold"
    assert _at(2, running=0, now=NIGHT, policy=policy).action == "down"  # 02:30: back to min_replicas
    assert _at(2, running=0, now=datetime(2026, 12, 3, 0, 30), policy=policy).replicas == 3  # across midnight
    assert _at(3, running=0, now=datetime(2026, 12, 3, 1, 0), policy=policy).action == "down"  # end is exclusive


def test_above_max_is_corrected_at_once() -> None:
    d = _at(5, running=100, since=0)
    assert (d.action, d.replicas) == ("down", 3)


@pytest.mark.parametrize("spec", ["8-20=2", "25:00-01:00=1", "08:00-08:00=1", "08:00-20:00"])
def test_bad_schedule_floors_are_refused(spec: str) -> None:
    with pytest.raises(ShardstackError, match="schedule floor"):
        ScheduleFloor.parse(spec)


@pytest.mark.parametrize("kwargs", [{"min_replicas": 3, "max_replicas": 2}, {"target_load": 0},
                                    {"scale_down_ratio": 1.0}, {"floors": (ScheduleFloor(clock(1), clock(2), 9),)}])
def test_bad_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ShardstackError, match="autoscale policy: need"):
        Policy(**kwargs)


# The signals as a real Prometheus has them: one built-in replica and one vLLM replica (whose raw series the role's
# recording rules rename), and HAProxy's backend queue, scraped every second from targets whose counters grow.
RULES = Path(__file__).resolve().parents[2] / "roles" / "prometheus" / "files" / "rules" / "vllm.rules.yml"
BUCKETS = (("0.1", 0), ("0.5", 5), ("1.0", 10), ("+Inf", 10))  # per scrape: 10 first tokens, half under 0.5 s


def _builtin(n: int) -> str:
    return "".join([
        "shardstack_infer_requests_running 3\nshardstack_infer_requests_waiting 1\n",
        f'shardstack_infer_requests_total{{code="200",api_key="-"}} {10 * n}\n',
        f'shardstack_infer_requests_total{{code="429",api_key="-"}} {2 * n}\n',
        *(f'shardstack_infer_time_to_first_token_seconds_bucket{{le="{le}"}} {c * n}\n' for le, c in BUCKETS)])


def _vllm(n: int) -> str:
    labels = 'model_name="m",engine="0"'
    return "".join([
        f"vllm:num_requests_running{{{labels}}} 2\nvllm:num_requests_waiting{{{labels}}} 4\n",
        f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {10 * n}\n',
        *(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{le}"}} {10 * n}\n' for le, _ in BUCKETS)])


def _haproxy(_n: int) -> str:
    return 'haproxy_backend_current_queue{proxy="inference"} 3\nhaproxy_backend_current_queue{proxy="stats"} 7\n'


def _target(render: Callable[[int], str]) -> ThreadingHTTPServer:
    scrapes = itertools.count(1)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = render(next(scrapes)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextlib.contextmanager
def _prometheus(tmp_path: Path, servers: dict[str, list[ThreadingHTTPServer]]) -> Iterator[str]:
    """A real Prometheus scraping `servers` (job → targets) every second, with the role's vLLM recording rules."""
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": job, "static_configs": [
                  {"targets": [f"127.0.0.1:{s.server_address[1]}" for s in group]}]}
                  for job, group in servers.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen([shutil.which("prometheus") or "/usr/bin/prometheus",
                                 f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for group in servers.values():
            for s in group:
                s.shutdown()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[str]:
    with _prometheus(tmp_path, {"inference": [_target(_builtin), _target(_vllm)],
                                "loadbalancer": [_target(_haproxy)]}) as base:
        yield base


def test_the_signals_from_a_real_prometheus_sum_both_engines_and_the_edges_queue(prometheus: str) -> None:
    query = functools.partial(prom_query, prometheus)
    deadline = time.monotonic() + 60

    def settled(got: Signals | None) -> bool:
        """The 5 s window full of samples from every target: before that the rates are extrapolated from a few."""
        return bool(got and got.running == 5 and got.ttft_p95 is not None and 1.5 <= got.refused_per_second <= 2.5
                    and got.ttft_p95 == pytest.approx(0.9, abs=0.05))

    got = None
    while not settled(got):
        assert time.monotonic() < deadline, f"Prometheus never had the signals: {got}"
        time.sleep(0.5)
        try:
            got = read_signals(query, replicas=2, window="5s")
        except ShardstackError:  # not listening yet
            got = None
    # 3 + 2 running; 1 + 4 waiting in the engines and 3 in HAProxy's inference queue (not the stats one). Settled:
    # 2 refusals per 1 s scrape, the built-in engine's only; 20 first tokens per scrape, 10 under 0.1 s (vLLM's),
    # 5 more under 0.5 s, so the 19th of 20 falls at 0.9 s.
    assert (got.replicas, got.running, got.waiting) == (2, 5, 8)


def test_no_series_reads_as_an_idle_tier_and_a_bad_window_is_refused() -> None:
    assert read_signals(lambda _q: [], 3) == Signals(3, 0.0, 0.0, None, 0.0)
    with pytest.raises(ShardstackError, match="expected a Prometheus duration"):
        read_signals(lambda _q: [], 3, window="1m]) or vector(1")


def test_the_decision_as_textfile_metrics_promtool_accepts(tmp_path: Path) -> None:
    d = _at(2, running=30, waiting=10, ttft=3.0, since=10)
    path = tmp_path / "autoscale.prom"
    state = State(decisions={"up": 2, "hold": 7}, changes=[
        {"time": 1_699_999_000.0, "action": "up", "from": 1, "to": 2, "reason": 'saturated: "load" 9/replica'}])
    write_metrics(path, d, POLICY, state, now=1_700_000_000.0)
    text = path.read_text()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert values[("shardstack_autoscale_replicas", (("kind", "current"),))] == 2
    assert values[("shardstack_autoscale_replicas", (("kind", "wanted"),))] == 2  # in the cooldown: hold
    assert values[("shardstack_autoscale_saturated", ())] == 1
    assert values[("shardstack_autoscale_max_replicas", ())] == 3
    assert values[("shardstack_autoscale_signal", (("name", "ttft_p95_seconds"),))] == 3.0
    assert values[("shardstack_autoscale_decisions_total", (("action", "hold"),))] == 7
    assert values[("shardstack_autoscale_last_decision_timestamp_seconds", ())] == 1_700_000_000.0
    assert values[("shardstack_autoscale_change_timestamp_seconds", (
        ("action", "up"), ("from_replicas", "1"), ("n", "1"), ("reason", 'saturated: "load" 9/replica'),
        ("to_replicas", "2")))] == 1_699_999_000.0
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _tier(running: float) -> Callable[[str], list[dict]]:
    """Prometheus's answers for a tier with `running` requests and nothing else (the signals' queries by name)."""
    return lambda q: [{"metric": {}, "value": [0, str(running)]}] if "requests_running" in q and running else []


def test_evaluations_carry_the_cooldown_and_the_counts_across_a_restart(tmp_path: Path) -> None:
    path, t0 = tmp_path / "state" / "autoscale.json", NOON.timestamp()
    state = State.load(path)  # none yet: no cooldown holds the first change
    up = evaluate(POLICY, _tier(20), 1, state, now=t0)
    assert (up.action, up.replicas, state.last_change) == ("up", 3, t0)
    state.save(path)
    state = State.load(path)  # a restart keeps the cooldown
    held = evaluate(POLICY, _tier(0), 3, state, now=t0 + 10)
    assert (held.action, held.replicas) == ("hold", 3) and "scale-down cooldown" in held.reason
    down = evaluate(POLICY, _tier(0), 3, state, now=t0 + 301)
    assert (down.action, down.replicas, state.last_change) == ("down", 2, t0 + 301)
    assert state.decisions == {"up": 1, "down": 1, "hold": 1}
    state.save(path)
    assert State.load(path) == state


def test_an_unreadable_state_is_an_error_not_a_reset(tmp_path: Path) -> None:
    path = tmp_path / "autoscale.json"
    for text in ("{not json", '{"decisions": {}}', "[]"):
        path.write_text(text)
        with pytest.raises(ShardstackError, match=r"autoscale state .* is unreadable"):
            State.load(path)


# The config file: what the role renders and the unit reads (`serve autoscale --config`).
def _config(tmp_path: Path, **keys: object) -> Path:
    doc = {"prometheus": "http://127.0.0.1:9", "state_file": str(tmp_path / "state" / "autoscale.json"), **keys}
    path = tmp_path / "autoscale.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_role_renders_a_config_the_loader_accepts(tmp_path: Path) -> None:
    ev = RoleEval("inference_service", {}, groups={"monitoring_server": ["ops01"]},
                  hostvars={"ops01": {"ansible_host": "10.0.0.5"}},
                  inference_service_autoscale_floors=["08:00-20:00=2"], inference_service_autoscale_max_ttft_p95=0)
    rendered = ev["__inference_service_autoscale_settings"]
    path = tmp_path / "autoscale.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(rendered))))
    cfg = AutoscaleConfig.load(path)
    assert (cfg.prometheus, cfg.min_replicas, cfg.max_replicas, cfg.job_user) == ("http://10.0.0.5:9090", 1, 2,
                                                                                  "shardstack")
    assert cfg.metrics_file == "/var/lib/prometheus/node-exporter/shardstack_autoscale.prom"
    policy = cfg.policy()
    assert policy.max_ttft_p95 is None and policy.floor(NOON) == 2 and policy.floor(NIGHT) == 1
    assert (policy.up_cooldown, policy.down_cooldown, cfg.interval) == (60, 300, 15)


@pytest.mark.parametrize(("keys", "error"), [
    ({"max_replica": 3}, "unknown config key 'max_replica'\n  hint: did you mean 'max_replicas'"),
    ({"max_replicas": "two"}, "config key 'max_replicas' is 'two'; expected"),
    ({"prometheus": "ops01:9090"}, "config key 'prometheus' is 'ops01:9090'"),
    ({"state_file": "state.json"}, "config key 'state_file' is 'state.json'; expected an absolute path"),
    ({"window": "1 minute"}, "config key 'window'"),
    ({"interval": 0}, "config key 'interval' is 0.0"),
    ({"floors": ["nights"]}, "schedule floor 'nights'"),
    ({"min_replicas": 3}, r"0 ≤ min_replicas \(3\) ≤ max_replicas \(2\)"),
    ({"qos": "a b"}, "replica qos 'a b' is not a Slurm name"),
    ({"job_user": "-x"}, "config key 'job_user'"),
])
def test_a_bad_config_is_one_line_naming_the_key(tmp_path: Path, keys: dict, error: str) -> None:
    with pytest.raises(ShardstackError, match=error):
        AutoscaleConfig.load(_config(tmp_path, **keys))
    proc = subprocess.run([sys.executable, "-m", "shardstack", "serve", "autoscale", "--config",
                           str(_config(tmp_path, **keys)), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stderr.startswith("shardstack: error: ") and "Traceback" not in proc.stderr


def test_check_accepts_a_good_config(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardstack", "serve", "autoscale", "--config",
                           str(_config(tmp_path, max_replicas=3)), "--check"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "a valid autoscaler config (1..3 replicas)" in proc.stdout, proc.stderr


class _Queue:
    """Slurm's queue of replica jobs, in memory, for the loop's bookkeeping (ops.replicas' Slurm interface; the real
    squeue/sbatch/scancel run in the Slurm lab: bench/elastic_lab.py). `fail_submit`: sbatch refuses."""

    def __init__(self, running: int = 0, fail_submit: bool = False) -> None:
        self.jobs = {100 + i: "RUNNING" for i in range(running)}
        self.fail_submit = fail_submit

    def query(self, argv: list[str]) -> str:
        if argv[0] == "scancel":
            for job in argv[1:]:
                self.jobs.pop(int(job))
            return ""
        return "".join(f"{j}|{s}|n{j}|2026-12-05T00:00:00\n" for j, s in sorted(self.jobs.items()))

    def submit(self, argv: list[str]) -> str:
        if self.fail_submit:
            raise ShardstackError("sbatch failed (exit 1): Invalid qos specification")
        job = max(self.jobs, default=99) + 1
        self.jobs[job] = "PENDING"
        return f"{job}\n"


def test_one_round_scales_to_the_decision_and_keeps_state_and_metrics(prometheus: str, tmp_path: Path) -> None:
    # The fixture's tier: 5 running and 8 waiting (both engines and the edge) against target 4: 4 replicas wanted.
    path = _config(tmp_path, prometheus=prometheus, metrics_file=str(tmp_path / "autoscale.prom"), max_replicas=4,
                   target_load=4.0, max_ttft_p95=None)
    cfg, queue = AutoscaleConfig.load(path), _Queue(running=1)
    _wait_for_load(prometheus)
    assert run(cfg, queue, once=True)
    assert sorted(queue.jobs.values()) == ["PENDING", "PENDING", "PENDING", "RUNNING"]
    state = State.load(Path(cfg.state_file))
    assert state.decisions["up"] == 1 and state.changes[0]["from"] == 1 and state.changes[0]["to"] == 4
    metrics = (tmp_path / "autoscale.prom").read_text()
    assert 'shardstack_autoscale_change_timestamp_seconds{action="up",from_replicas="1",n="1"' in metrics


def _wait_for_load(prometheus: str) -> None:
    """Until Prometheus is up and has scraped the whole tier's load: every target, not the first one alone."""
    deadline = time.monotonic() + 60
    while True:
        try:
            got = read_signals(functools.partial(prom_query, prometheus), 1)
            if (got.running, got.waiting) == (5, 8):
                return
        except ShardstackError:
            pass
        assert time.monotonic() < deadline, "no load in Prometheus within 60 s"
        time.sleep(1)


def test_a_change_slurm_refused_starts_no_cooldown(prometheus: str, tmp_path: Path) -> None:
    cfg = AutoscaleConfig.load(_config(tmp_path, prometheus=prometheus, target_load=4.0, max_replicas=4))
    _wait_for_load(prometheus)
    queue = _Queue(running=1, fail_submit=True)
    assert run(cfg, queue, once=True) is False
    assert not Path(cfg.state_file).exists()  # refused: the state (and its cooldown clock) untouched
    queue.fail_submit = False
    assert run(cfg, queue, once=True) and len(queue.jobs) > 1  # the next round carries it out, no cooldown held


def test_one_autoscaler_per_state(tmp_path: Path) -> None:
    cfg = AutoscaleConfig.load(_config(tmp_path))
    Path(cfg.state_file).parent.mkdir(parents=True)
    with Path(cfg.state_file).with_suffix(".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ShardstackError, match="another autoscaler runs with this state"):
            run(cfg, _Queue(), once=True)


def test_unreachable_prometheus_or_slurm_is_a_skipped_decision_not_an_end(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    cfg = AutoscaleConfig.load(_config(tmp_path))  # nothing listens on port 9
    assert run(cfg, _Queue(), once=True) is False
    assert "autoscale: no decision: http://127.0.0.1:9" in caplog.text
    cfg = AutoscaleConfig.load(_config(tmp_path, interval=0.01))
    ended = time.monotonic() + 2
    assert run(cfg, LocalSlurm(timeout=5), stopping=lambda: time.monotonic() > ended) is False
    assert caplog.text.count("autoscale: no decision: squeue") > 3  # Slurm is asked first; every round skipped


def test_status_reads_the_decisions_node_exporter_serves(tmp_path: Path) -> None:
    """write_metrics' file, served as node_exporter serves a textfile and scraped by a real Prometheus, is what
    `shardstack status` shows: the counts, the floor, saturation and the last changes, newest first."""
    state = State(decisions={"up": 2, "down": 1, "hold": 9}, changes=[
        {"time": 1_764_900_000.0, "action": "down", "from": 2, "to": 1, "reason": "idle: load 0 over 1 replica(s)"},
        {"time": 1_764_899_000.0, "action": "up", "from": 1, "to": 2, "reason": "saturated: 3 refused/s"}])
    path = tmp_path / "autoscale.prom"
    write_metrics(path, _at(1, running=2), POLICY, state, now=1_764_900_100.0)
    with _prometheus(tmp_path, {"node": [_target(lambda _n: path.read_text())]}) as base:
        deadline = time.monotonic() + 60
        while True:
            try:
                got = status_ops._autoscaler(prom_query(base, '{__name__=~"shardstack_autoscale_.+"}'))
            except ShardstackError:
                got = None
            if got and len(got["changes"]) == 2:
                break
            assert time.monotonic() < deadline, "Prometheus never had the autoscaler's metrics"
            time.sleep(1)
    assert {k: got[k] for k in ("current", "wanted", "min_replicas", "max_replicas", "floor", "saturated",
                                "last_decision")} == {"current": 1, "wanted": 1, "min_replicas": 1, "max_replicas": 3,
                                                      "floor": 1, "saturated": False, "last_decision": 1_764_900_100.0}
    assert [(c["n"], c["action"], c["from"], c["to"], c["reason"]) for c in got["changes"]] == [
        (1, "down", 2, 1, "idle: load 0 over 1 replica(s)"), (2, "up", 1, 2, "saturated: 3 refused/s")]
