"""The autoscaler's decision (ops/autoscale.py) on a clock the test moves: scale-out under load, hysteresis, the
cooldowns, the maximum, scale to and from zero, and a schedule floor."""

from __future__ import annotations

import functools
import itertools
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from datetime import time as clock
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from shardstack.errors import ShardstackError
from shardstack.ops.autoscale import (
    Policy,
    ScheduleFloor,
    Signals,
    State,
    decide,
    evaluate,
    read_signals,
    write_metrics,
)
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


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[str]:
    servers = {"inference": [_target(_builtin), _target(_vllm)], "loadbalancer": [_target(_haproxy)]}
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
    write_metrics(path, d, POLICY, {"up": 2, "hold": 7}, now=1_700_000_000.0)
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
