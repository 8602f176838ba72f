"""The acceptance's verdicts: pure functions of the measured records (records.py), so they are tested on a real
run's data (tests/ops/data); running the jobs is run.py's."""

from __future__ import annotations

import itertools
import math
import re
import statistics
from typing import Any

from shardstack.ops.acceptance.records import Item, Run
from shardstack.ops.validate import node_facts


def judge_loss(off: Run, on: Run, rtol: float) -> Item:
    """Partitioning off (stage 0) and on (stage 3): same seed, data and world size, so the same losses up to the
    order of floating-point reductions."""
    thr = f"max relative difference ≤ {rtol:g}"
    item = Item("loss", "loss curves, ZeRO stage 0 vs stage 3", "fail", "-", thr,
                data={"stage0": off.losses, "stage3": on.losses, "nodes": on.nodes})
    for run in (off, on):
        if run.error or run.state != "finished":
            item.measured = f"stage {run.stage} run {run.state or 'not run'}"
            item.details.append(f"job {run.job}: {run.error or run.state}")
            return item
    a, b = off.losses, on.losses
    common = sorted(set(a) & set(b))
    if not common or set(a) != set(b):
        item.measured = f"steps differ: stage 0 logged {len(a)}, stage 3 {len(b)}"
        return item
    diffs = {s: abs(b[s] - a[s]) / max(abs(a[s]), 1e-12) for s in common}
    worst = max(diffs, key=diffs.__getitem__)
    item.data["rel_diff"] = diffs
    item.measured = (f"max rel. diff {diffs[worst]:.2e} (step {worst}) over {len(common)} steps; final loss "
                     f"{a[common[-1]]:.4f} vs {b[common[-1]]:.4f}")
    item.status = "pass" if diffs[worst] <= rtol else "fail"
    return item


def scaling_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope (tokens/s per added node) and intercept of tokens/s over nodes."""
    xs, ys = [float(n) for n, _ in points], [t for _, t in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    return slope, intercept


def judge_scaling(runs: list[Run], min_efficiency: float, max_efficiency: float = 1.25) -> Item:
    """Weak scaling: the same batch per node at 1 … N nodes. Efficiency at N = tps(N) / (N · tps(1)); the slope,
    normalised by tps(1), is 1.0 for linear scaling. An efficiency above `max_efficiency` fails too: with the same
    work per node, N nodes cannot do much more than N times one node's, so the runs were not alike and the figure
    says nothing about scaling."""
    thr = f"{min_efficiency:g} ≤ efficiency at the most nodes ≤ {max_efficiency:g}"
    item = Item("scaling", "throughput and scaling (stage 3)", "fail", "-", thr)
    bad = [r for r in runs if r.error or r.state != "finished" or r.tokens_per_second is None]
    item.data["points"] = [{"nodes": r.nodes, "tokens_per_second": r.tokens_per_second,
                            "iqr": r.tokens_per_second_iqr, "step_seconds": r.step_seconds}
                           for r in sorted(runs, key=lambda r: r.nodes)]
    if bad:
        item.measured = ", ".join(f"{r.nodes} node(s): {r.error or r.state or 'no records'}" for r in bad)
        return item
    points = sorted((r.nodes, float(r.tokens_per_second)) for r in runs)  # type: ignore[arg-type]
    tput = ", ".join(f"{n} node(s) {t:,.0f}" for n, t in points)
    if len(points) < 2 or points[0][0] != 1:
        item.status, item.measured = "n/a", f"tokens/s: {tput}; one node count only, nothing to scale"
        return item
    base = points[0][1]
    eff = {n: t / (n * base) for n, t in points}
    slope, intercept = scaling_fit(points)
    top = points[-1][0]
    item.data.update(efficiency=eff, slope=slope, intercept=intercept, normalised_slope=slope / base)
    item.measured = (f"tokens/s {tput}; efficiency at {top} nodes {eff[top]:.2f}; slope {slope:,.0f} tok/s per node "
                     f"({slope / base:.2f} of one node's)")
    if any(e > max_efficiency for e in eff.values()):
        item.details.append(f"more than linear (above {max_efficiency:g}): one node did less per node than "
                            f"{top} did, so the runs were not alike (other load on shared cores, a slower one-node "
                            "path); compare the step seconds in the runs table")
    item.status = "pass" if min_efficiency <= eff[top] <= max_efficiency and all(
        e <= max_efficiency for e in eff.values()) else "fail"
    return item


def sweep_points(allreduce: dict[str, Any]) -> list[dict[str, Any]]:
    """validate's all-reduce per size: its `sweep` when it has one, else its single measured size."""
    if sweep := allreduce.get("sweep"):
        return sorted(({"bytes": int(p["bytes"]), "seconds_min": float(p["seconds_min"]),
                        "algbw_gbps": float(p["algbw_gbps"]), "busbw_gbps": float(p["busbw_gbps"])}
                       for p in sweep), key=lambda p: p["bytes"])
    return [{"bytes": int(allreduce["bytes"]), "seconds_min": float(allreduce["seconds_min"]),
             "algbw_gbps": float(allreduce["algbw_gbps"]), "busbw_gbps": float(allreduce["busbw_gbps"])}]


def flops_per_token(record: dict[str, Any], world_size: int) -> float | None:
    """The model's FLOPs per token, back from what the trainer logged: mfu = F · tokens/s ÷ (peak · world)."""
    mfu, peak, tps = record.get("mfu"), record.get("peak_tflops_per_device"), record.get("tokens_per_second")
    if not mfu or not peak or not tps:
        return None
    return float(mfu) * float(peak) * 1e12 * world_size / float(tps)


def judge_bandwidth(allreduce: dict[str, Any] | None, run: Run | None, max_fraction: float) -> Item:
    """Bandwidth is not the bottleneck when moving the model's gradients at the measured bus bandwidth takes at most
    `max_fraction` of a step. Gradient bytes: 4 per parameter (fp32; bf16 moves half), parameters from the
    trainer's FLOPs/token ÷ 6 (PaLM's 6N + attention: an upper bound, so the estimate errs towards failing).
    Traffic: one all-reduce for stages 0–2; stage 3 all-gathers in forward and backward and reduce-scatters,
    1.5 all-reduces' worth. The bus bandwidth is the one measured at the size nearest the gradients'."""
    thr = f"gradient traffic ≤ {max_fraction:g} of a step"
    item = Item("bandwidth", "all-reduce bus bandwidth", "fail", "-", thr)
    if not allreduce:
        item.measured = "validate published no all-reduce result"
        return item
    points = sweep_points(allreduce)
    item.data.update(points=points, backend=allreduce.get("backend"), world_size=allreduce.get("world_size"),
                     nodes=allreduce.get("nodes"), sweep=bool(allreduce.get("sweep")))
    per_size = ", ".join(f"{_size(p['bytes'])} {p['busbw_gbps']:.2f}" for p in points)
    item.measured = f"busbw Gbit/s by size: {per_size} ({allreduce.get('backend')}, {allreduce.get('nodes')} nodes)"
    if not allreduce.get("correct", True):
        item.details.append("the all-reduce's sum was wrong")
        return item
    if run is None or run.error or run.state != "finished" or not run.timed or run.nodes < 2:
        item.details.append("no multi-node stage-3 run to compare the traffic with")
        return item
    fpt = flops_per_token(run.timed[-1], run.nodes)
    if fpt is None:
        item.details.append("the trainer's records carry no MFU to derive the model size from")
        return item
    params = fpt / 6
    grad_bytes = 4 * params
    nearest = min(points, key=lambda p: abs(math.log(p["bytes"] / grad_bytes)))
    n = run.nodes
    volume = (1.5 if run.stage == 3 else 1.0) * grad_bytes * 2 * (n - 1) / n
    comm = volume * 8 / (nearest["busbw_gbps"] * 1e9)
    step = float(run.step_seconds or 0)
    fraction = comm / step if step else math.inf
    item.data.update(grad_bytes=grad_bytes, comm_seconds=comm, step_seconds=step, fraction=fraction,
                     busbw_used=nearest)
    item.measured += (f"; gradients ≈{_size(grad_bytes)} → {comm * 1e3:.2f} ms of traffic per step at "
                      f"{nearest['busbw_gbps']:.2f} Gbit/s vs a {step * 1e3:.1f} ms step at {n} nodes "
                      f"({fraction:.1%})")
    if len(points) == 1 and abs(math.log(nearest["bytes"] / grad_bytes)) > math.log(4):
        item.details.append(f"bus bandwidth measured at {_size(nearest['bytes'])} only, the gradients are "
                            f"≈{_size(grad_bytes)}: smaller messages are more latency-bound, so this estimate is "
                            "optimistic (validate's sweep, where published, measures each size)")
    item.status = "pass" if fraction <= max_fraction else "fail"
    return item


def _size(nbytes: float) -> str:
    for unit_, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit_}"
    return f"{nbytes:.0f} B"


def gpu_train_nodes(gpu: dict[str, Any], nodes: list[str]) -> list[str] | None:
    """Which of `nodes` have NVIDIA GPUs, from validate's node facts; None when no node published facts."""
    facts = {h: node_facts(r) for h, r in gpu.items() if h in nodes}
    if not any(f is not None for f in facts.values()):
        return None
    return [h for h, f in facts.items() if f is not None and f.has_nvidia]


def judge_gpu(gpu_nodes: list[str] | None, samples: dict[str, float | None] | None, memory_bytes: int | None,
              min_util: float) -> Item:
    """GPU utilisation from DCGM (Prometheus) over the N-node run where the train nodes have GPUs; n/a on CPU
    nodes. `samples`: {"utilization": mean ratio, "memory": max used ratio} as Prometheus answered (None: none)."""
    thr = f"mean utilisation ≥ {min_util:.0%}"
    item = Item("gpu", "GPU utilisation and memory", "fail", "-", thr)
    if gpu_nodes is None:
        item.measured = "validate published no node facts"
        return item
    if not gpu_nodes:
        item.status, item.measured = "n/a", "not applicable: no GPU on the train nodes"
        return item
    util = (samples or {}).get("utilization")
    mem = (samples or {}).get("memory")
    item.data.update(nodes=gpu_nodes, utilization=util, memory_ratio=mem, trainer_memory_bytes=memory_bytes)
    if util is None:
        item.measured = "no DCGM utilisation samples in Prometheus over the run"
        item.details.append("is dcgm-exporter scraped (shardstack status)? a longer run (--steps) spans more "
                            "scrape intervals")
        return item
    memory = f", framebuffer used max {mem:.0%}" if mem is not None else ""
    trainer = f", rank 0 peak allocated {memory_bytes / 2**30:.2f} GiB" if memory_bytes else ""
    item.measured = f"utilisation {util:.0%} on {', '.join(gpu_nodes)}{memory}{trainer}"
    item.status = "pass" if util >= min_util else "fail"
    return item


def resume_point(records: list[dict[str, Any]]) -> int | None:
    """The checkpoint step the job resumed from: the records of one job's json_log go back in steps where a
    restarted run began again after its checkpoint; None when they never do."""
    for prev, rec in itertools.pairwise(records):
        if rec["step"] <= prev["step"]:
            return rec["step"] - 1
    return None


def judge_resume(run: Run, killed: str | None, total_steps: int, rtol: float, min_resume: int,
                 logged_resume: int | None = None) -> Item:
    """The worker killed, the job resumed from a checkpoint at or after `min_resume` (the one the kill waited for),
    finished at `total_steps`, and its re-run steps repeat the losses logged before the kill (same data, state and
    RNG from the checkpoint). `logged_resume`: the step of the checkpoint the trainer's log says it resumed from
    (the records alone cannot tell a kill that landed right at a checkpoint from no kill)."""
    thr = f"resumes from step ≥ {min_resume}, finishes at {total_steps}, re-run losses within {rtol:g}"
    item = Item("resume", "a worker killed, the job resumed", "fail", "-", thr,
                data={"records": [{"step": r["step"], "loss": r["loss"]} for r in run.records], "killed": killed})
    if killed is None or (run.error and not run.records):
        item.measured = run.error or "no worker was killed"
        return item
    frm = logged_resume if logged_resume is not None else resume_point(run.records)
    item.data["resumed_from"] = frm
    last = run.records[-1]["step"] if run.records else None
    if frm is None:
        item.measured = f"{killed}; no resume in the job's log or records (last step {last}, job {run.state})"
        return item
    steps = [r["step"] for r in run.records]
    cut = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if cut is None:  # killed right after the checkpoint it resumed from: nothing re-run
        cut = next((i for i, s in enumerate(steps) if s > frm), len(steps))
    before = {r["step"]: float(r["loss"]) for r in run.records[:cut]}
    after = {r["step"]: float(r["loss"]) for r in run.records[cut:]}
    rerun = sorted(set(before) & set(after))
    diffs = [abs(after[s] - before[s]) / max(abs(before[s]), 1e-12) for s in rerun]
    worst = max(diffs, default=0.0)
    killed_at = max(before, default=0)
    item.data.update(killed_at=killed_at, rerun_steps=rerun, rerun_max_rel_diff=worst)
    item.measured = (f"{killed}; killed after step {killed_at}, resumed from the step-{frm} checkpoint, "
                     f"job {run.state} at step {last}; {len(rerun)} re-run step(s), max rel. loss diff {worst:.1e}")
    ok = (run.state == "finished" and last == total_steps and frm >= min_resume
          and sorted(after) == list(range(frm + 1, total_steps + 1)) and worst <= rtol)
    if run.error:
        item.details.append(run.error)
    item.status = "pass" if ok else "fail"
    return item


def logged_resume_step(log: str, checkpoint_dir: str) -> int | None:
    """The step of the newest checkpoint of `checkpoint_dir` the trainer's log says it resumed from."""
    found = re.findall(rf"resumed from {re.escape(checkpoint_dir)}/step_(\d+)", log)
    return int(found[-1]) if found else None


def judge_time(seconds: float, budget: float | None) -> Item:
    thr = f"≤ {budget / 60:.1f} min" if budget else "no budget set"
    item = Item("time", "end-to-end time", "n/a", f"{seconds / 60:.1f} min ({seconds:.0f} s)", thr, seconds=seconds)
    if budget:
        item.status = "pass" if seconds <= budget else "fail"
    return item
