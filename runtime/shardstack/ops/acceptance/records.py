"""The acceptance's records: its thresholds and run sizes, each run's per-step records and what they add up to, each
item's verdict and the whole result (what report.py renders and `--json` prints)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from shardstack.errors import ShardstackError

Status = Literal["pass", "fail", "n/a"]


@dataclass(frozen=True)
class Thresholds:
    """What each item is judged against. The defaults are the lab's honest ones (see docs/operations.md,
    "Acceptance"): its nodes share the host's few cores, so N nodes cannot give N times one node's tokens/s; on real
    GPU servers raise `min_scaling_efficiency` to what the guide asks (e.g. 0.9)."""

    loss_rtol: float = 0.01  # max |loss_stage3 − loss_stage0| / |loss_stage0| over the steps
    min_scaling_efficiency: float = 0.35  # tps(N) / (N · tps(1))
    # Above this the runs were not alike (weak scaling cannot beat linear by much): no measurement of scaling.
    max_scaling_efficiency: float = 1.25
    max_comm_fraction: float = 0.25  # gradient traffic time at the measured busbw / the N-node step time
    min_gpu_utilization: float = 0.85  # DCGM GPU utilisation, mean over the N-node run's window

    def __post_init__(self) -> None:
        for name in ("loss_rtol", "min_scaling_efficiency", "max_scaling_efficiency", "max_comm_fraction",
                     "min_gpu_utilization"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ShardstackError(f"threshold {name} must be a positive number, not {value!r}")
        for name in ("min_scaling_efficiency", "min_gpu_utilization", "max_comm_fraction"):
            if getattr(self, name) > 1:
                raise ShardstackError(f"threshold {name} is a fraction (0–1], not {getattr(self, name)}")
        if self.max_scaling_efficiency <= self.min_scaling_efficiency:
            raise ShardstackError(f"threshold max_scaling_efficiency ({self.max_scaling_efficiency}) must be above "
                                  f"min_scaling_efficiency ({self.min_scaling_efficiency})")


@dataclass(frozen=True)
class Settings:
    """The runs' sizes (small by default, so the whole acceptance takes minutes on the lab) and how many runs' records
    stay on shared storage."""

    steps: int = 50  # optimizer steps of each loss/throughput run
    kill_steps: int = 150  # steps of the kill-and-resume job (long enough that the kill lands mid-run)
    checkpoint_interval: int = 20  # the kill job's checkpoint interval; the kill waits for the second one
    # Sequences per node per step (global batch = this × nodes: weak scaling); enough that a tiny model's step is
    # compute, not the shared host's scheduling noise.
    batch_per_node: int = 16
    model_size: str = "tiny"  # a GPT size (shardstack.model.shapes), byte-level, on the shipped corpus
    seed: int = 1337
    max_nodes: int | None = None  # scale up to this many train nodes (default: every usable one)
    allreduce_mb: float | None = None  # validate's all-reduce size (its sweep's largest); None: validate's default
    job_timeout: float = 900.0  # seconds one job may take
    time_budget: float | None = None  # seconds the whole acceptance may take (None: reported, not judged)
    # Acceptance run directories kept on shared storage, this run's included: nothing else prunes them (the artefact
    # prune leaves checkpoints/ alone), and each holds every run's records and the kill job's checkpoints.
    keep_runs: int = 3

    def __post_init__(self) -> None:
        for name in ("steps", "kill_steps", "checkpoint_interval", "batch_per_node", "keep_runs"):
            if getattr(self, name) < 1:
                raise ShardstackError(f"{name.replace('_', '-')} must be ≥ 1")
        if self.steps < 3:
            raise ShardstackError("steps must be ≥ 3: the first step pays for warm-up and is not timed")
        if self.kill_steps < 3 * self.checkpoint_interval:
            raise ShardstackError(f"kill-steps ({self.kill_steps}) must be ≥ 3 × the checkpoint interval "
                                  f"({self.checkpoint_interval}): the kill lands after the second checkpoint and "
                                  "the job must still be running then")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ShardstackError("max-nodes must be ≥ 1")
        if ((self.allreduce_mb is not None and self.allreduce_mb <= 0) or self.job_timeout <= 0
                or (self.time_budget is not None and self.time_budget <= 0)):
            raise ShardstackError("allreduce-mb, job timeout and time budget must be positive")


@dataclass
class Run:
    """One job of the acceptance and the per-step records its rank 0 wrote (metrics.json_log)."""

    job: str
    nodes: int
    stage: int
    seconds: float = 0.0  # submit to finished, on the controller
    state: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: float(r["loss"]) for r in self.records}

    @property
    def timed(self) -> list[dict[str, Any]]:
        """The records that measure throughput: all but the run's first step (warm-up, allocation, connections)."""
        return self.records[1:]

    @property
    def tokens_per_second(self) -> float | None:
        timed = self.timed
        return statistics.median(r["tokens_per_second"] for r in timed) if timed else None

    @property
    def tokens_per_second_iqr(self) -> tuple[float, float] | None:
        """The timed steps' tokens/s quartiles (25 %, 75 %): how much the median can be trusted."""
        timed = [r["tokens_per_second"] for r in self.timed]
        if len(timed) < 2:
            return None
        q = statistics.quantiles(timed, n=4)
        return q[0], q[2]

    @property
    def step_seconds(self) -> float | None:
        timed = self.timed
        return statistics.median(r["step_seconds"] for r in timed) if timed else None

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "nodes": self.nodes, "stage": self.stage, "seconds": round(self.seconds, 1),
                "state": self.state, "error": self.error, "tokens_per_second": self.tokens_per_second,
                "tokens_per_second_iqr": self.tokens_per_second_iqr,
                "step_seconds": self.step_seconds, "records": self.records}


@dataclass
class Item:
    """One acceptance item: its verdict against a stated threshold, the figure measured, what it rests on."""

    key: str
    title: str
    status: Status
    measured: str
    threshold: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Acceptance:
    """The whole acceptance: filled in as it goes, so a caller that catches an error still has what ran."""

    inventory: str
    settings: Settings
    thresholds: Thresholds
    started: float = field(default_factory=time.time)  # Unix time
    seconds: float = 0.0
    items: list[Item] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    allreduce: dict[str, Any] | None = None
    validate_gpu: dict[str, Any] = field(default_factory=dict)  # validate's node facts, per node
    validate_findings: list[str] = field(default_factory=list)
    run_dir: str = ""

    @property
    def passed(self) -> bool:
        return all(i.status != "fail" for i in self.items)

    def item(self, key: str) -> Item | None:
        return next((i for i in self.items if i.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {"inventory": self.inventory, "settings": dataclasses.asdict(self.settings),
                "thresholds": dataclasses.asdict(self.thresholds), "started": self.started,
                "seconds": round(self.seconds, 1), "passed": self.passed, "run_dir": self.run_dir,
                "items": [i.to_dict() for i in self.items], "runs": [r.to_dict() for r in self.runs],
                "allreduce": self.allreduce, "validate_gpu": self.validate_gpu,
                "validate_findings": self.validate_findings}
