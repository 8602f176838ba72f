"""The autoscaler's decision (ops/autoscale.py) on a clock the test moves: scale-out under load, hysteresis, the
cooldowns, the maximum, scale to and from zero, and a schedule floor."""

from __future__ import annotations

from datetime import datetime, time

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops.autoscale import Policy, ScheduleFloor, Signals, decide

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
                    floors=(ScheduleFloor.parse("08:00-20:00=2"), ScheduleFloor(time(23), time(1), 3)))
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
                                    {"scale_down_ratio": 1.0}, {"floors": (ScheduleFloor(time(1), time(2), 9),)}])
def test_bad_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ShardstackError, match="autoscale policy: need"):
        Policy(**kwargs)
