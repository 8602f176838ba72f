"""The inference autoscaler's decision: from the tier's load (what Prometheus records for every replica, whichever
engine) to a replica count between a floor and `max_replicas`, with hysteresis and cooldowns, so a noisy minute
neither adds nor removes a replica. `decide` is pure: the caller reads the signals (`read_signals`, from
Prometheus) and carries the state; every decision keeps its inputs, so a log line or a metric (`write_metrics`, a
node_exporter textfile) can say why. `run` is the loop the unit on the Slurm controller runs (`shardstack serve
autoscale --config`, an `AutoscaleConfig`): evaluate, scale through a `replicas.Slurm`, keep the state.

The rule, per evaluation:
- the floor is `min_replicas`, or a schedule's higher floor while it is in force (e.g. the day's peak hours);
- the load per replica is (running + waiting) / replicas; the tier is *saturated* when that exceeds
  `target_load`, when requests wait more than `max_waiting` per replica, when TTFT p95 exceeds `max_ttft_p95`, or
  when the tier answered 429s. Saturated: want ceil((running + waiting) / target_load) replicas (at least one more);
- it is *idle* when the load per replica, spread over one replica less, stays under `scale_down_ratio` ×
  `target_load`, nothing waits and nothing was refused: want one replica less;
- the wish is clamped to [floor, max_replicas]; a scale-up waits `up_cooldown` after the last change, a scale-down
  `down_cooldown` (longer: a replica costs a model load to bring back). Below the floor or above the maximum the
  count is corrected at once.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import math
import os
import re
import tempfile
import time as clock
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, time
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from shardstack.errors import ShardstackError
from shardstack.ops.replicas import ReplicaSettings, Slurm, replicas, scale
from shardstack.ops.status import prom_query
from shardstack.ops.train import SLURM_NAME
from shardstack.train.config import read_yaml, typed

log = logging.getLogger(__name__)

Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class ScheduleFloor:
    """A higher floor between two wall-clock times of day (`start` ≤ t < `end`; across midnight when end < start)."""

    start: time
    end: time
    min_replicas: int

    def active(self, now: datetime) -> bool:
        t = now.time()
        return self.start <= t < self.end if self.start <= self.end else (t >= self.start or t < self.end)

    @classmethod
    def parse(cls, spec: str) -> ScheduleFloor:
        """`HH:MM-HH:MM=N`, e.g. `08:00-20:00=3`."""
        m = re.fullmatch(r"\s*(\d\d):(\d\d)-(\d\d):(\d\d)=(\d+)\s*", spec)
        if not m:
            raise ShardstackError(f"schedule floor {spec!r}: expected HH:MM-HH:MM=N (e.g. 08:00-20:00=3)")
        h1, m1, h2, m2, n = (int(g) for g in m.groups())
        if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59 or (h1, m1) == (h2, m2):
            raise ShardstackError(f"schedule floor {spec!r}: not a time range of a day")
        return cls(time(h1, m1), time(h2, m2), n)


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 2
    target_load: float = 8.0  # running + waiting requests one replica should carry
    max_waiting: float = 4.0  # waiting requests per replica that count as saturated whatever the load
    max_ttft_p95: float | None = 2.0  # seconds; None: TTFT is not a signal
    scale_down_ratio: float = 0.5  # hysteresis: scale down only below this share of target_load (after removal)
    up_cooldown: float = 60.0  # seconds after the last change before a scale-up
    down_cooldown: float = 300.0  # seconds after the last change before a scale-down
    floors: Sequence[ScheduleFloor] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.min_replicas <= self.max_replicas:
            problems.append(f"0 ≤ min_replicas ({self.min_replicas}) ≤ max_replicas ({self.max_replicas})")
        if self.target_load <= 0 or self.max_waiting < 0:
            problems.append("target_load > 0 and max_waiting ≥ 0")
        if not 0 < self.scale_down_ratio < 1:
            problems.append(f"0 < scale_down_ratio ({self.scale_down_ratio}) < 1")
        if self.up_cooldown < 0 or self.down_cooldown < 0:
            problems.append("cooldowns ≥ 0")
        problems += [f"a schedule floor of {f.min_replicas} within [0, max_replicas]" for f in self.floors
                     if not 0 <= f.min_replicas <= self.max_replicas]
        if problems:
            raise ShardstackError("autoscale policy: need " + "; ".join(problems))

    def floor(self, now: datetime) -> int:
        return max([self.min_replicas] + [f.min_replicas for f in self.floors if f.active(now)])


@dataclass(frozen=True)
class Signals:
    """The tier's load as Prometheus has it, summed over the replicas that serve."""

    replicas: int  # replicas that exist now (serving or starting)
    running: float  # requests being generated
    waiting: float  # requests admitted and waiting for a slot
    ttft_p95: float | None = None  # seconds, over the last window; None when nothing was served
    refused_per_second: float = 0.0  # 429s the tier answered, over the last window


@dataclass(frozen=True)
class Decision:
    replicas: int  # the count wanted now
    action: Action
    reason: str
    floor: int
    signals: Signals
    saturated: bool  # also true when at max_replicas and unable to grow (the alert's condition)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One journal line: the decision and every input it was made from."""
        s = self.signals
        ttft = "-" if s.ttft_p95 is None else f"{s.ttft_p95:.3f}s"
        return (f"autoscale: {self.action} {s.replicas}→{self.replicas} ({self.reason}); running={s.running:g} "
                f"waiting={s.waiting:g} ttft_p95={ttft} refused/s={s.refused_per_second:g} floor={self.floor}")


def decide(policy: Policy, signals: Signals, *, now: datetime, since_change: float) -> Decision:
    """The replica count for these signals; `since_change`: seconds since the count last changed."""
    current, floor = signals.replicas, policy.floor(now)
    load = signals.running + signals.waiting
    per_replica = load / current if current else math.inf if load else 0.0
    reasons = []
    if per_replica > policy.target_load:
        reasons.append(f"load {per_replica:.1f}/replica > {policy.target_load:g}")
    if current and signals.waiting / current > policy.max_waiting:
        reasons.append(f"waiting {signals.waiting / current:.1f}/replica > {policy.max_waiting:g}")
    if policy.max_ttft_p95 is not None and signals.ttft_p95 is not None and signals.ttft_p95 > policy.max_ttft_p95:
        reasons.append(f"TTFT p95 {signals.ttft_p95:.2f}s > {policy.max_ttft_p95:g}s")
    if signals.refused_per_second > 0:
        reasons.append(f"{signals.refused_per_second:g} refused/s")
    saturated = bool(reasons)

    def made(replicas: int, action: Action, reason: str) -> Decision:
        return Decision(replicas, action, reason, floor, signals, saturated)

    if current < floor:
        return made(floor, "up", f"below the floor of {floor}")
    if current > policy.max_replicas:
        return made(policy.max_replicas, "down", f"above max_replicas {policy.max_replicas}")
    if saturated:
        want = min(policy.max_replicas, max(current + 1, math.ceil(load / policy.target_load)))
        if want <= current:
            return made(current, "hold", f"at max_replicas {policy.max_replicas} and saturated: " + "; ".join(reasons))
        if since_change < policy.up_cooldown:
            return made(current, "hold", f"saturated, in the scale-up cooldown ({since_change:.0f}s of "
                                         f"{policy.up_cooldown:g}s): " + "; ".join(reasons))
        return made(want, "up", "saturated: " + "; ".join(reasons))
    fewer = current - 1
    left = load / fewer if fewer > 0 else math.inf if load else 0.0  # the load each remaining replica would carry
    idle = (fewer >= floor and signals.waiting == 0 and signals.refused_per_second == 0
            and left < policy.scale_down_ratio * policy.target_load)
    if not idle:
        return made(current, "hold", "within target" if current > floor else f"at the floor of {floor}")
    if since_change < policy.down_cooldown:
        return made(current, "hold", f"idle, in the scale-down cooldown ({since_change:.0f}s of "
                                     f"{policy.down_cooldown:g}s)")
    return made(fewer, "down", f"idle: load {load:g} over {fewer} replica(s) < "
                               f"{policy.scale_down_ratio:g} × {policy.target_load:g}")


# What the autoscaler reads, as Prometheus instant queries over every replica of the tier whichever its engine
# (vllm.rules.yml records vLLM's series under the built-in engine's names). HAProxy's queue for the backend counts
# as waiting: requests that found every replica at its connection limit wait there, not in an engine. Refusals are
# the built-in engine's 429s (its admission queue full); vLLM queues without refusing, and the edge's own 429s are
# per-client rate limits, which more replicas would not lift.
SIGNAL_QUERIES = {
    "running": 'sum(shardstack_infer_requests_running{job="inference"})',
    "waiting": 'sum(shardstack_infer_requests_waiting{job="inference"})',
    "edge_waiting": 'sum(haproxy_backend_current_queue{job="loadbalancer",proxy="inference"})',
    "ttft_p95": 'histogram_quantile(0.95, sum by (le) '
                '(rate(shardstack_infer_time_to_first_token_seconds_bucket{job="inference"}[WINDOW])))',
    "refused_per_second": 'sum(rate(shardstack_infer_requests_total{job="inference",code="429"}[WINDOW]))',
}

Query = Callable[[str], list[dict[str, Any]]]
WINDOW = re.compile(r"[1-9][0-9]*[smh]")


def _scalar(query: Query, promql: str) -> float | None:
    """The value of a one-element vector; None when it is empty or not a number (a quantile of no requests)."""
    result = query(promql)
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) or math.isinf(value) else value


def read_signals(query: Query, replicas: int, window: str = "1m") -> Signals:
    """The tier's signals from Prometheus (`query`: an instant query, e.g. ops.status.prom_query bound to a URL);
    `window`: the range the rates and the TTFT quantile are taken over."""
    if not WINDOW.fullmatch(window):
        raise ShardstackError(f"autoscale window {window!r}: expected a Prometheus duration such as 1m or 90s")
    got = {name: _scalar(query, promql.replace("WINDOW", window)) for name, promql in SIGNAL_QUERIES.items()}
    return Signals(replicas=replicas, running=got["running"] or 0.0,
                   waiting=(got["waiting"] or 0.0) + (got["edge_waiting"] or 0.0),
                   ttft_p95=got["ttft_p95"], refused_per_second=got["refused_per_second"] or 0.0)


def write_metrics(path: Path, decision: Decision, policy: Policy, state: State, now: float) -> None:
    """The decision as node_exporter textfile metrics (atomically replaced): what the alerts and `status` read.
    From `state`: how many of each action so far and the last changes (the caller keeps both across restarts)."""
    registry = CollectorRegistry()
    replicas = Gauge("shardstack_autoscale_replicas", "Inference replicas: current, and wanted by the last decision",
                     ["kind"], registry=registry)
    replicas.labels("current").set(decision.signals.replicas)
    replicas.labels("wanted").set(decision.replicas)
    for name, value, doc in (("min_replicas", policy.min_replicas, "The policy's minimum"),
                             ("max_replicas", policy.max_replicas, "The policy's maximum"),
                             ("floor", decision.floor, "The floor in force (min_replicas or a schedule's)"),
                             ("saturated", int(decision.saturated), "1 when the last decision found the tier "
                                                                   "saturated"),
                             ("last_decision_timestamp_seconds", now, "When the autoscaler last decided")):
        Gauge(f"shardstack_autoscale_{name}", doc, registry=registry).set(value)
    signal = Gauge("shardstack_autoscale_signal", "The inputs of the last decision", ["name"], registry=registry)
    s = decision.signals
    for name, value in (("running", s.running), ("waiting", s.waiting), ("refused_per_second", s.refused_per_second),
                        ("ttft_p95_seconds", s.ttft_p95)):
        if value is not None:
            signal.labels(name).set(value)
    total = Counter("shardstack_autoscale_decisions", "Decisions made, by action", ["action"], registry=registry)
    for action in ("up", "down", "hold"):
        total.labels(action).inc(state.decisions.get(action, 0))
    # A series per change, not per decision: a change's reason is a new label value only when the count changes.
    change = Gauge("shardstack_autoscale_change_timestamp_seconds", "The last changes of the replica count, newest "
                   "first (n=1), with their reasons", ["n", "action", "from_replicas", "to_replicas", "reason"],
                   registry=registry)
    for n, c in enumerate(state.changes, 1):
        change.labels(str(n), c["action"], str(c["from"]), str(c["to"]), c["reason"]).set(c["time"])
    write_to_textfile(str(path), registry)


CHANGES_KEPT = 5


@dataclass
class State:
    """What the autoscaler carries between evaluations and across restarts: when the count last changed (epoch
    seconds; 0: never, so no cooldown holds the first change), how many decisions of each action it made, and its
    last changes, newest first (`{"time", "action", "from", "to", "reason"}`, for `shardstack status`)."""

    last_change: float = 0.0
    decisions: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "hold": 0})
    changes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> State:
        """The saved state; a new one when there is none. A file that is not this state is an error, not a reset:
        a reset would drop the cooldown (and could flap the tier)."""
        try:
            doc = json.loads(path.read_text())
            changes = [{"time": float(c["time"]), "action": str(c["action"]), "from": int(c["from"]),
                        "to": int(c["to"]), "reason": str(c["reason"])} for c in doc.get("changes", [])]
            return cls(float(doc["last_change"]), {a: int(doc["decisions"].get(a, 0)) for a in ("up", "down", "hold")},
                       changes[:CHANGES_KEPT])
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ShardstackError(f"autoscale state {path} is unreadable ({exc})",
                                  hint="remove it to start afresh (the next change then waits no cooldown)") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)


def evaluate(policy: Policy, query: Query, replicas: int, state: State, *, now: float,
             window: str = "1m") -> Decision:
    """One evaluation: the signals from Prometheus for the `replicas` that exist, the decision, and the state
    updated as if the caller carries it out (it must, or keep the state it had)."""
    signals = read_signals(query, replicas, window)
    since = now - state.last_change if state.last_change else math.inf
    decision = decide(policy, signals, now=datetime.fromtimestamp(now), since_change=since)
    state.decisions[decision.action] += 1
    if decision.replicas != replicas:
        state.last_change = now
        change = {"time": now, "action": decision.action, "from": replicas, "to": decision.replicas,
                  "reason": decision.reason}
        state.changes = [change, *state.changes][:CHANGES_KEPT]
    return decision


@dataclass
class AutoscaleConfig:
    """The autoscaler's settings, one YAML file (the inference_service role renders it for the unit on the Slurm
    controller; docs/serving.md, "Autoscaling"): Prometheus, the policy, the replicas' Slurm account, QOS and node
    feature, where it keeps its state and writes its metrics."""

    prometheus: str = ""  # Prometheus's base URL, e.g. http://ops01:9090
    state_file: str = ""  # the cooldown clock and the decision counts, kept across restarts
    metrics_file: str | None = None  # node_exporter textfile; None: no metrics
    interval: float = 15.0  # seconds between decisions
    window: str = "1m"  # the range of the rates and the TTFT quantile
    dry_run: bool = False  # decide and log, never submit or cancel
    min_replicas: int = Policy.min_replicas
    max_replicas: int = Policy.max_replicas
    target_load: float = Policy.target_load
    max_waiting: float = Policy.max_waiting
    max_ttft_p95: float | None = Policy.max_ttft_p95
    scale_down_ratio: float = Policy.scale_down_ratio
    up_cooldown: float = Policy.up_cooldown
    down_cooldown: float = Policy.down_cooldown
    floors: list[str] = field(default_factory=list)  # HH:MM-HH:MM=N, local time
    job_user: str = ""  # who submits replica jobs (root's unit: sbatch drops to it); "": this process's user
    account: str = "inference"
    qos: str = "inference"
    feature: str = "inference"

    def policy(self) -> Policy:
        return Policy(min_replicas=self.min_replicas, max_replicas=self.max_replicas, target_load=self.target_load,
                      max_waiting=self.max_waiting, max_ttft_p95=self.max_ttft_p95,
                      scale_down_ratio=self.scale_down_ratio, up_cooldown=self.up_cooldown,
                      down_cooldown=self.down_cooldown, floors=tuple(ScheduleFloor.parse(f) for f in self.floors))

    def settings(self) -> ReplicaSettings:
        return ReplicaSettings(account=self.account, qos=self.qos, feature=self.feature)

    @classmethod
    def load(cls, path: str | Path) -> AutoscaleConfig:
        """The file, checked whole: every problem is one line that names its key."""
        cfg = typed(cls, read_yaml(path))
        if not re.fullmatch(r"https?://[^/\s]+/?", cfg.prometheus):
            raise ShardstackError(f"config key 'prometheus' is {cfg.prometheus!r}; expected Prometheus's base URL "
                                  "(http://HOST:PORT)")
        if not cfg.state_file.startswith("/"):
            raise ShardstackError(f"config key 'state_file' is {cfg.state_file!r}; expected an absolute path")
        if cfg.metrics_file is not None and not cfg.metrics_file.startswith("/"):
            raise ShardstackError(f"config key 'metrics_file' is {cfg.metrics_file!r}; expected an absolute path")
        if cfg.interval <= 0:
            raise ShardstackError(f"config key 'interval' is {cfg.interval!r}; expected seconds > 0")
        if not WINDOW.fullmatch(cfg.window):
            raise ShardstackError(f"config key 'window' is {cfg.window!r}; expected a Prometheus duration such as "
                                  "1m or 90s")
        if cfg.job_user and not SLURM_NAME.match(cfg.job_user):
            raise ShardstackError(f"config key 'job_user' is {cfg.job_user!r}; expected a user name")
        cfg.policy()
        cfg.settings()
        return cfg


def run(cfg: AutoscaleConfig, slurm: Slurm, *, once: bool = False, dry_run: bool = False,
        stopping: Callable[[], bool] = lambda: False) -> bool:
    """Decide every `cfg.interval` seconds and scale to the decision until `stopping()`; one log line per decision
    with its inputs. Prometheus or Slurm out of reach is a decision skipped, logged, not an end. One autoscaler per
    state file (a lock beside it): two would each correct the other's count. Returns whether the last evaluation
    decided."""
    policy, settings, dry_run = cfg.policy(), cfg.settings(), dry_run or cfg.dry_run
    state_path = Path(cfg.state_file)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    lock = state_path.with_suffix(".lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ShardstackError(f"another autoscaler runs with this state (lock {lock.name})") from None
    state = State.load(state_path)
    log.info("autoscale: %d..%d replica(s), every %gs, Prometheus %s, state %s%s", policy.min_replicas,
             policy.max_replicas, cfg.interval, cfg.prometheus, state_path, " (dry run)" if dry_run else "")
    decided = False
    while not stopping():
        started = clock.time()
        try:
            current = len(replicas(slurm))
            after = copy.deepcopy(state)  # kept only once the decision is carried out
            decision = evaluate(policy, lambda q: prom_query(cfg.prometheus, q), current, after, now=started,
                                window=cfg.window)
            log.info("%s%s", decision.line(), " (dry run)" if dry_run else "")
            if decision.replicas != current and not dry_run:
                done = scale(slurm, decision.replicas, settings)
                log.info("autoscale: submitted %s, cancelled %s", done.submitted or "none", done.cancelled or "none")
            state = after
            state.save(state_path)
            if cfg.metrics_file:
                write_metrics(Path(cfg.metrics_file), decision, policy, state, started)
            decided = True
        except ShardstackError as exc:
            log.error("autoscale: no decision: %s", str(exc).replace("\n  hint:", "; hint:"))
            decided = False
        if once:
            break
        while not stopping() and clock.time() < started + cfg.interval:
            clock.sleep(0.2)
    return decided
