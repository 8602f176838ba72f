"""The acceptance's judging and its report, on measured data: tests/ops/data/acceptance_lab.json holds what one
`shardstack acceptance` run on the 3-node lab recorded (every job's per-step records as the trainer wrote them,
validate's all-reduce and node facts; bench/RESULTS.md) and, as `sweep`, three all-reduces of
`shardstack.node.allreduce` measured on the CI host (2 gloo ranks; 64 KiB, 1 MiB, 16 MiB) in the shape validate's
sweep publishes. The plots are rendered for real (matplotlib, Agg) and read back with Pillow."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from shardstack.errors import ShardstackError
from shardstack.ops.acceptance import judge as acc
from shardstack.ops.acceptance import records, report
from shardstack.ops.acceptance import run as acc_run

DATA = json.loads((Path(__file__).parent / "data" / "acceptance_lab.json").read_text())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _runs() -> dict[str, records.Run]:
    return {r["job"]: records.Run(r["job"], r["nodes"], r["stage"], r["seconds"], r["state"], r["records"], r["error"])
            for r in copy.deepcopy(DATA["runs"])}


def _top(runs: dict[str, records.Run]) -> int:
    return max(r.nodes for r in runs.values())


def test_the_lab_records_are_what_the_trainer_writes() -> None:
    """The fixture is a real run's: one record per step, each with the trainer's fields."""
    runs = _runs()
    assert {"acc-kill", "acc-s0-n2", "acc-s3-n2", "acc-s3-n1"} <= set(runs)
    for run in runs.values():
        assert run.state == "finished" and run.records, run.job
        assert {"step", "loss", "tokens_per_second", "step_seconds", "mfu", "peak_tflops_per_device",
                "memory_bytes"} <= set(run.records[0])


# ---- loss -----------------------------------------------------------------------------------------------------------

def test_stage0_and_stage3_agree_on_the_lab_and_a_changed_loss_fails() -> None:
    runs = _runs()
    top = _top(runs)
    off, on = runs[f"acc-s0-n{top}"], runs[f"acc-s3-n{top}"]
    item = acc.judge_loss(off, on, rtol=0.01)
    worst = max(abs(on.losses[s] - off.losses[s]) / off.losses[s] for s in off.losses)
    assert item.status == "pass" and worst <= 0.01, item.measured
    assert f"over {len(off.records)} steps" in item.measured
    # One step's loss 5% off: the item fails and names that step.
    bad = dataclasses.replace(on, records=copy.deepcopy(on.records))
    bad.records[7]["loss"] *= 1.05
    failed = acc.judge_loss(off, bad, rtol=0.01)
    assert failed.status == "fail" and f"(step {bad.records[7]['step']})" in failed.measured, failed.measured


def test_the_loss_item_fails_on_a_run_that_did_not_finish_or_logged_other_steps() -> None:
    runs = _runs()
    top = _top(runs)
    off, on = runs[f"acc-s0-n{top}"], runs[f"acc-s3-n{top}"]
    failed = dataclasses.replace(on, state="failed", error="job ended failed")
    assert acc.judge_loss(off, failed, 0.01).status == "fail"
    short = dataclasses.replace(on, records=on.records[:-3])
    item = acc.judge_loss(off, short, 0.01)
    assert item.status == "fail" and "steps differ" in item.measured


# ---- scaling --------------------------------------------------------------------------------------------------------

def test_scaling_efficiency_and_slope_from_the_lab_runs() -> None:
    runs = _runs()
    top = _top(runs)
    scale = [runs[f"acc-s3-n{n}"] for n in range(1, top + 1)]
    median = {r.nodes: statistics.median(x["tokens_per_second"] for x in r.records[1:]) for r in scale}
    eff = median[top] / (top * median[1])
    item = acc.judge_scaling(scale, min_efficiency=eff * 0.99, max_efficiency=eff * 1.01)
    assert item.status == "pass" and item.data["efficiency"][top] == pytest.approx(eff), item.measured
    assert acc.judge_scaling(scale, min_efficiency=eff * 1.01, max_efficiency=eff * 2).status == "fail"
    # Above the plausible maximum fails, and says why.
    high = acc.judge_scaling(scale, min_efficiency=eff * 0.5, max_efficiency=eff * 0.99)
    assert high.status == "fail" and any("more than linear" in d for d in high.details), high.details
    # The recorded lab run: its one-node baseline was slower per node than the two-node run (bench/RESULTS.md).
    default = acc.judge_scaling(scale, records.Thresholds().min_scaling_efficiency)
    assert default.status == ("fail" if eff > records.Thresholds().max_scaling_efficiency else "pass")
    # Two points: the least-squares slope is the difference of the two.
    if top == 2:
        assert item.data["slope"] == pytest.approx(median[2] - median[1])
    assert f"efficiency at {top} nodes {eff:.2f}" in item.measured


def test_one_node_is_not_applicable_and_a_failed_run_fails_scaling() -> None:
    runs = _runs()
    one = acc.judge_scaling([runs["acc-s3-n1"]], 0.5)
    assert one.status == "n/a" and "nothing to scale" in one.measured
    broken = dataclasses.replace(runs["acc-s3-n1"], state="timeout", error="job acc-s3-n1 still running after 900s")
    item = acc.judge_scaling([runs["acc-s3-n2"], broken], 0.1)
    assert item.status == "fail" and "still running" in item.measured


# ---- bandwidth ------------------------------------------------------------------------------------------------------

def test_the_single_point_validate_publishes_today_is_used_without_a_sweep() -> None:
    runs = _runs()
    ar = DATA["allreduce"]
    assert "sweep" not in ar
    points = acc.sweep_points(ar)
    assert points == [{"bytes": ar["bytes"], "seconds_min": ar["seconds_min"], "algbw_gbps": ar["algbw_gbps"],
                       "busbw_gbps": ar["busbw_gbps"]}]
    item = acc.judge_bandwidth(ar, runs[f"acc-s3-n{_top(runs)}"], max_fraction=0.25)
    assert item.data["busbw_used"] == points[0]
    assert item.status == ("pass" if item.data["fraction"] <= 0.25 else "fail")
    # The fraction is the traffic over the step, as stated: 1.5 all-reduces of 4-byte gradients at stage 3.
    n, grad = runs["acc-s3-n2"].nodes, item.data["grad_bytes"]
    traffic = 1.5 * grad * 2 * (n - 1) / n * 8 / (points[0]["busbw_gbps"] * 1e9)
    assert item.data["comm_seconds"] == pytest.approx(traffic)
    assert item.data["fraction"] == pytest.approx(traffic / runs["acc-s3-n2"].step_seconds)
    tight = acc.judge_bandwidth(ar, runs["acc-s3-n2"], max_fraction=item.data["fraction"] * 0.9)
    assert tight.status == "fail"


def test_a_sweep_is_used_per_size_and_the_nearest_size_to_the_gradients_judges() -> None:
    ar = {**DATA["allreduce"], "sweep": DATA["sweep"]}
    points = acc.sweep_points(ar)
    assert [p["bytes"] for p in points] == sorted(p["bytes"] for p in DATA["sweep"]) and len(points) == 3
    item = acc.judge_bandwidth(ar, _runs()["acc-s3-n2"], 0.25)
    grad = item.data["grad_bytes"]
    import math

    nearest = min(DATA["sweep"], key=lambda p: abs(math.log(p["bytes"] / grad)))
    assert item.data["busbw_used"]["bytes"] == nearest["bytes"]
    assert item.measured.count("Gbit/s") >= 2 and "64 KiB" in item.measured


def test_no_all_reduce_or_a_wrong_sum_fails_the_bandwidth_item() -> None:
    run = _runs()["acc-s3-n2"]
    assert acc.judge_bandwidth(None, run, 0.25).status == "fail"
    wrong = acc.judge_bandwidth({**DATA["allreduce"], "correct": False}, run, 0.25)
    assert wrong.status == "fail" and "sum was wrong" in wrong.details[0]


def test_flops_per_token_comes_back_from_the_trainers_record() -> None:
    """mfu = F · tokens/s ÷ (peak · world): the trainer's own formula, inverted. The tiny GPT (d 64, 2 layers, 256
    bytes, seq 64): 6N + 12·L·d·T with N ≈ 2·12·64² + the output projection of the tied embedding (256·64)."""
    rec = _runs()["acc-s3-n2"].records[-1]
    f = acc.flops_per_token(rec, 2)
    expected = 6 * (2 * 12 * 64 * 64 + 256 * 64) + 12 * 2 * 64 * 64
    assert f == pytest.approx(expected, rel=0.15), f  # mfu is logged to 5 decimals


# ---- GPU ------------------------------------------------------------------------------------------------------------

def test_cpu_lab_nodes_make_the_gpu_item_not_applicable() -> None:
    nodes = sorted(h for h, r in DATA["validate_gpu"].items() if r.get("train_node"))
    found = acc.gpu_train_nodes(DATA["validate_gpu"], nodes)
    assert found == []
    item = acc.judge_gpu(found, None, None, 0.85)
    assert item.status == "n/a" and item.measured == "not applicable: no GPU on the train nodes"
    assert acc.gpu_train_nodes({}, nodes) is None
    assert acc.judge_gpu(None, None, None, 0.85).status == "fail"


def _with_gpus(report: dict[str, Any]) -> dict[str, Any]:
    # The lab's own facts as an NVIDIA node would publish them: PCI shows GPUs (what has_nvidia reads).
    out = copy.deepcopy(report)
    out["accel"]["facts"].update(gpus=["0000:17:00.0"], nvidia_functions=1)
    return out


def test_gpu_nodes_are_judged_on_dcgm_and_never_pass_without_samples() -> None:
    host, rep = next((h, r) for h, r in DATA["validate_gpu"].items() if r.get("train_node"))
    gpu = acc.gpu_train_nodes({host: _with_gpus(rep)}, [host])
    if gpu != [host]:  # the facts' schema names GPUs otherwise: the test must not pass vacuously
        pytest.fail(f"facts with a GPU were not seen as an NVIDIA node: {rep['accel']['facts'].keys()}")
    missing = acc.judge_gpu(gpu, {"utilization": None, "memory": None}, 2**30, 0.85)
    assert missing.status == "fail" and "no DCGM utilisation samples" in missing.measured
    assert acc.judge_gpu(gpu, {"utilization": 0.91, "memory": 0.5}, 2**30, 0.85).status == "pass"
    low = acc.judge_gpu(gpu, {"utilization": 0.6, "memory": None}, None, 0.85)
    assert low.status == "fail" and "utilisation 60%" in low.measured


# ---- kill and resume ------------------------------------------------------------------------------------------------

def test_the_lab_kill_resumed_from_a_checkpoint_and_repeated_its_losses() -> None:
    kill = _runs()["acc-kill"]
    s = records.Settings(**DATA["settings"])
    frm = acc.resume_point(kill.records)
    killed = DATA["killed"]
    item = acc.judge_resume(kill, killed, s.kill_steps, 0.01, 2 * s.checkpoint_interval, DATA["logged_resume"])
    assert item.status == "pass", item.measured
    assert item.data["resumed_from"] == DATA["logged_resume"] and frm in (None, DATA["logged_resume"])
    assert item.data["resumed_from"] % s.checkpoint_interval == 0
    # Resumed from a checkpoint before the one the kill waited for: fails.
    assert acc.judge_resume(kill, killed, s.kill_steps, 0.01, item.data["resumed_from"] + 1,
                            DATA["logged_resume"]).status == "fail"
    # No kill, or a job that did not reach its last step: fails.
    assert acc.judge_resume(kill, None, s.kill_steps, 0.01, 1, DATA["logged_resume"]).status == "fail"
    short = dataclasses.replace(kill, records=kill.records[:-1])
    assert acc.judge_resume(short, killed, s.kill_steps, 0.01, 1, DATA["logged_resume"]).status == "fail"


def test_a_resume_that_does_not_repeat_the_losses_fails() -> None:
    kill = _runs()["acc-kill"]
    item = acc.judge_resume(kill, DATA["killed"], kill.records[-1]["step"], 0.01, 1, DATA["logged_resume"])
    rerun = item.data["rerun_steps"]
    assert rerun, "the recorded kill landed after its checkpoint: steps ran twice"
    bad = dataclasses.replace(kill, records=copy.deepcopy(kill.records))
    # The last record of the re-run stretch (after the resume) changes by 10%.
    last_rerun = max(i for i, r in enumerate(bad.records) if r["step"] == rerun[-1])
    bad.records[last_rerun]["loss"] *= 1.1
    failed = acc.judge_resume(bad, DATA["killed"], kill.records[-1]["step"], 0.01, 1, DATA["logged_resume"])
    assert failed.status == "fail" and failed.data["rerun_max_rel_diff"] > 0.09


def test_resume_point_reads_the_step_going_back() -> None:
    steps = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4, 5, 3, 4, 5, 6)]
    assert acc.resume_point(steps) == 2
    assert acc.resume_point(steps[:5]) is None
    log = ("x resumed from /mnt/lab-shared/acceptance/T/checkpoints/acc-kill/step_00000040 (step 40, saved by 2 "
           "ranks at stage 3; now 2 ranks) in 0.3s")
    assert acc.logged_resume_step(log, "/mnt/lab-shared/acceptance/T/checkpoints/acc-kill") == 40
    assert acc.logged_resume_step(log, "/mnt/lab-shared/acceptance/U/checkpoints/acc-kill") is None



def test_the_kill_script_keeps_a_path_and_a_unit_with_spaces_and_semicolons_one_word(tmp_path: Path) -> None:
    """The script as the node's sh runs it, on a real directory whose name would run `touch` if it were not quoted:
    the manifest is found (past exit 3), the unit is not running here (exit 4), and nothing else ran."""
    ckpt = tmp_path / "run a; touch pwned; b" / "acc-kill"
    (ckpt / "step_00000040").mkdir(parents=True)
    (ckpt / "step_00000040" / "manifest.json").write_text("{}")
    script = acc_run.kill_script("acc; touch pwned-unit; x", str(ckpt), 40, polls=1)
    assert subprocess.run(["sh", "-n", "-c", script], check=False).returncode == 0
    proc = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, (proc.returncode, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run a; touch pwned; b"]
    # Before its checkpoint exists: exit 3 once the polls are spent.
    missing = subprocess.run(["sh", "-c", acc_run.kill_script("acc-kill", str(ckpt), 60, polls=1)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3 and not missing.stderr, (missing.returncode, missing.stderr)


# ---- the run directories --------------------------------------------------------------------------------------------

def test_the_oldest_acceptance_runs_are_pruned_so_keep_remain_with_this_one() -> None:
    current = acc_run.run_name(1_800_000_000)
    assert current == "acceptance-20270115T080000Z"
    old = [acc_run.run_name(1_700_000_000 + d * 86_400) for d in range(5)]  # five days' runs, listed out of order
    names = [old[3], "acceptance-x", old[0], "acc-kill", old[4], "acceptance-2026", old[2], old[1], current]
    assert acc_run.runs_to_prune(names, 3, current) == old[:3]  # two older ones kept, this run the third
    assert acc_run.runs_to_prune(names, 1, current) == old
    assert acc_run.runs_to_prune(names, 6, current) == []
    assert acc_run.runs_to_prune([], 3, current) == []
    with pytest.raises(ShardstackError, match="keep-runs must be ≥ 1"):
        acc_run.runs_to_prune(names, 0, current)
    with pytest.raises(ShardstackError, match="keep-runs must be ≥ 1"):
        records.Settings(keep_runs=0)

# ---- settings and thresholds ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_rtol": -1}, "loss_rtol must be a positive number"),
    ({"min_gpu_utilization": 85}, "is a fraction"),
    ({"max_comm_fraction": float("nan")}, "max_comm_fraction must be a positive number"),
    ({"min_scaling_efficiency": 0.5, "max_scaling_efficiency": 0.4}, "must be above min_scaling_efficiency"),
])
def test_thresholds_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ShardstackError, match=message):
        records.Thresholds(**kwargs)


def test_time_is_judged_only_against_a_budget() -> None:
    assert acc.judge_time(600, None).status == "n/a"
    assert acc.judge_time(600, 900).status == "pass"
    assert acc.judge_time(600, 300).status == "fail"


# ---- the report -----------------------------------------------------------------------------------------------------

def _acceptance(sweep: bool) -> records.Acceptance:
    runs = _runs()
    top = _top(runs)
    s, t = records.Settings(**DATA["settings"]), records.Thresholds()
    ar = {**DATA["allreduce"], "sweep": DATA["sweep"]} if sweep else DATA["allreduce"]
    on = runs[f"acc-s3-n{top}"]
    res = records.Acceptance("/tmp/acc/hosts.yml", s, t, started=1_764_800_000.0, seconds=512.0,
                             runs=list(runs.values()), allreduce=ar,
                             run_dir="/mnt/lab-shared/acceptance/20251203T220000Z")
    res.items = [
        acc.judge_loss(runs[f"acc-s0-n{top}"], on, t.loss_rtol),
        acc.judge_scaling([runs[f"acc-s3-n{n}"] for n in range(1, top + 1)], t.min_scaling_efficiency),
        acc.judge_bandwidth(ar, on, t.max_comm_fraction),
        acc.judge_gpu([], None, None, t.min_gpu_utilization),
        acc.judge_resume(runs["acc-kill"], DATA["killed"], s.kill_steps, t.loss_rtol, 2 * s.checkpoint_interval,
                         DATA["logged_resume"]),
        acc.judge_time(512.0, None),
    ]
    return res


@pytest.mark.parametrize("sweep", [False, True])
def test_the_report_has_the_table_first_and_real_plots(tmp_path: Path, sweep: bool) -> None:
    res = _acceptance(sweep)
    md = report.write(res, tmp_path).read_text()
    lines = md.splitlines()
    assert lines[0] == f"# shardstack acceptance: {'PASSED' if res.passed else 'FAILED'}"
    head = lines.index("| item | result | measured | threshold | seconds |")
    rows = lines[head + 2: head + 2 + len(res.items)]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == [i.title for i in res.items]
    assert [r.split(" | ")[1] for r in rows] == [report.MARK[i.status] for i in res.items]
    assert "| GPU utilisation and memory | n/a | not applicable: no GPU on the train nodes |" in md
    assert head < md.splitlines().index("## Runs")
    for key, name in report.PLOTS.items():
        png = tmp_path / name
        assert f"]({name})" in md, key
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(png) as im:
            im.load()
            assert im.size == ((600, 450) if key in ("scaling", "bandwidth") else (700, 550) if key == "loss"
                               else (700, 450))
            # Something was drawn: far more than the background's colour.
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["acceptance.md", *report.PLOTS.values()])


def test_a_failed_run_leaves_its_plot_out_and_the_report_says_failed(tmp_path: Path) -> None:
    res = _acceptance(False)
    res.items[0] = acc.judge_loss(records.Run("acc-s0-n2", 2, 0, state="failed", error="job ended failed"),
                                  records.Run("acc-s3-n2", 2, 3, state="failed", error="job ended failed"), 0.01)
    md = report.write(res, tmp_path).read_text()
    assert md.startswith("# shardstack acceptance: FAILED")
    assert "| loss curves, ZeRO stage 0 vs stage 3 | FAIL | stage 0 run failed |" in md
    assert not (tmp_path / "loss.png").exists() and (tmp_path / "scaling.png").exists()


def test_the_verdict_rows_are_the_terminal_tables_too() -> None:
    from shardstack.cli.acceptance import verdict_table

    res = _acceptance(True)
    table = verdict_table(res)
    assert table.row_count == len(res.items)
    assert [c.header for c in table.columns] == ["item", "result", "measured", "threshold", "seconds"]
    assert list(table.columns[0].cells) == [i.title for i in res.items]
