"""The acceptance's one report: `DIR/acceptance.md` with the verdict table at the top and a section per item, and
its plots as PNGs beside it (matplotlib, Agg: no display). matplotlib is imported here, when a report is written,
so the ops layer stays importable on a controller without it."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.acceptance.records import Acceptance, Item

MARK = {"pass": "PASS", "fail": "FAIL", "n/a": "n/a"}
PLOTS = {"loss": "loss.png", "scaling": "scaling.png", "bandwidth": "allreduce.png", "resume": "resume.png"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ShardstackError("the acceptance report's plots need matplotlib",
                              hint="pip install 'shardstack[ops]' (or: pip install matplotlib)") from None
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is not the report's
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path) -> None:
    """Every plot ends alike: the legend of `ax` (None: placed already), a tight layout, a PNG at 100 dpi, the figure
    freed."""
    if ax is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def plot_loss(item: Item, path: Path) -> None:
    plt = _pyplot()
    off, on = item.data.get("stage0") or {}, item.data.get("stage3") or {}
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 1])
    for losses, label, style in ((off, "ZeRO stage 0 (partitioning off)", "-"),
                                 (on, "ZeRO stage 3 (partitioning on)", "--")):
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], style, label=label)
    ax.set_ylabel("training loss")
    ax.set_title(f"same job, seed and data on {item.data.get('nodes', '?')} node(s)")
    ax.legend()  # on the loss panel, not the difference panel below it
    diffs = item.data.get("rel_diff") or {}
    if diffs:
        steps = sorted(diffs)
        dx.semilogy(steps, [max(diffs[s], 1e-12) for s in steps], ".-", color="tab:red")
    dx.set_ylabel("|Δ| / loss (0 at 1e-12)")
    dx.set_xlabel("step")
    _save(plt, fig, None, path)


def plot_scaling(item: Item, path: Path) -> None:
    plt = _pyplot()
    pts = [p for p in item.data.get("points") or [] if p.get("tokens_per_second")]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = [p["nodes"] for p in pts]
    ys = [p["tokens_per_second"] for p in pts]
    iqr = [p.get("iqr") or (p["tokens_per_second"],) * 2 for p in pts]
    ax.errorbar(xs, ys, yerr=[[y - q[0] for y, q in zip(ys, iqr, strict=True)],
                              [q[1] - y for y, q in zip(ys, iqr, strict=True)]],
                fmt="o-", capsize=4, label="measured: median, bars 25–75 % of the steps")
    base = next((p["tokens_per_second"] for p in pts if p["nodes"] == 1), None)
    if base:
        ax.plot(xs, [n * base for n in xs], ":", color="gray", label="linear: N × one node")
    if "slope" in item.data:
        s, b = item.data["slope"], item.data["intercept"]
        ax.plot(xs, [s * n + b for n in xs], "--", color="tab:orange", label=f"least squares: {s:,.0f} tok/s per node")
    for p in pts:
        eff = (item.data.get("efficiency") or {}).get(p["nodes"])
        if eff is not None:
            ax.annotate(f"{eff:.2f}", (p["nodes"], p["tokens_per_second"]), textcoords="offset points",
                        xytext=(6, -12))
    ax.set_xticks(xs or [1])
    ax.set_xlabel("train nodes")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title("weak scaling, ZeRO stage 3 (labels: efficiency)")
    _save(plt, fig, ax, path)


def plot_allreduce(item: Item, path: Path) -> None:
    plt = _pyplot()
    pts = item.data.get("points") or []
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.semilogx([p["bytes"] for p in pts], [p["busbw_gbps"] for p in pts], "o-", label="bus bandwidth")
    ax.semilogx([p["bytes"] for p in pts], [p["algbw_gbps"] for p in pts], "s:", label="algorithm bandwidth")
    if grad := item.data.get("grad_bytes"):
        ax.axvline(grad, color="gray", ls="--", label="the model's gradients")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("Gbit/s")
    ax.set_ylim(bottom=0)
    two = " (2 ranks: busbw = algbw)" if item.data.get("world_size") == 2 else ""
    ax.set_title(f"all-reduce, {item.data.get('backend')} over {item.data.get('nodes')} node(s)"
                 + ("" if item.data.get("sweep") else ", one size") + ("\n" + two.strip() if two else ""),
                 fontsize="medium")
    _save(plt, fig, ax, path)


def plot_resume(item: Item, path: Path) -> None:
    plt = _pyplot()
    recs = item.data.get("records") or []
    frm = item.data.get("resumed_from")
    steps = [r["step"] for r in recs]
    cut = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if cut is None and frm is not None:
        cut = next((i for i, s in enumerate(steps) if s > frm), len(steps))
    cut = len(recs) if cut is None else cut
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(steps[:cut], [r["loss"] for r in recs[:cut]], "-", label="before the kill")
    if recs[cut:]:
        ax.plot(steps[cut:], [r["loss"] for r in recs[cut:]], "--", label="after the resume")
    if frm is not None:
        ax.axvline(frm, color="gray", ls=":", label=f"checkpoint resumed from (step {frm})")
    if (k := item.data.get("killed_at")) is not None:
        ax.axvline(k, color="tab:red", ls=":", label=f"worker killed (after step {k})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("kill and resume")
    _save(plt, fig, ax, path)


_PLOTTERS = {"loss": plot_loss, "scaling": plot_scaling, "bandwidth": plot_allreduce, "resume": plot_resume}


def _plottable(item: Item) -> bool:
    if item.key == "loss":
        return bool(item.data.get("stage0") or item.data.get("stage3"))
    if item.key == "scaling":
        return any(p.get("tokens_per_second") for p in item.data.get("points") or [])
    if item.key == "bandwidth":
        return bool(item.data.get("points"))
    if item.key == "resume":
        return bool(item.data.get("records"))
    return False


def verdict_rows(result: Acceptance) -> list[tuple[str, str, str, str, str]]:
    """(item, result, measured, threshold, seconds) for each item: the table at the top of the report and on the
    terminal."""
    return [(i.title, MARK[i.status], i.measured, i.threshold, f"{i.seconds:.0f}") for i in result.items]


def write(result: Acceptance, out: Path) -> Path:
    """Write DIR/acceptance.md and its PNGs; return the Markdown's path."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardstackError(f"cannot create the report directory {out}: {exc.strerror}") from None
    plots: dict[str, str] = {}
    for item in result.items:
        if item.key in _PLOTTERS and _plottable(item):
            _PLOTTERS[item.key](item, out / PLOTS[item.key])
            plots[item.key] = PLOTS[item.key]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(result.started))
    verdict = "PASSED" if result.passed else "FAILED"
    lines = [f"# shardstack acceptance: {verdict}", "",
             f"{when}, inventory `{result.inventory}`, {result.seconds / 60:.1f} min end to end. "
             f"Records of the runs: `{result.run_dir}` on the cluster's shared storage.", "",
             "| item | result | measured | threshold | seconds |", "| --- | --- | --- | --- | ---: |"]
    lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in verdict_rows(result)]
    for item in result.items:
        lines += ["", f"## {item.title}: {MARK[item.status]}", "", f"Measured: {item.measured}.", "",
                  f"Threshold: {item.threshold}. Seconds: {item.seconds:.0f}."]
        if item.details:
            lines += ["", *[f"- {_cell(d)}" for d in item.details]]
        if item.key in plots:
            lines += ["", f"![{item.title}]({plots[item.key]})"]
    lines += ["", "## Runs", "", "Tokens/s and step seconds: medians of each run's steps after its first; the "
              "spread is the 25–75 % range.", "",
              "| job | nodes | ZeRO stage | steps logged | median tokens/s | spread "
              "| median step s | seconds | state |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in result.runs:
        tps = f"{r.tokens_per_second:,.0f}" if r.tokens_per_second else "-"
        q = r.tokens_per_second_iqr
        iqr = f"{q[0]:,.0f}–{q[1]:,.0f}" if q else "-"
        step = f"{r.step_seconds:.4f}" if r.step_seconds else "-"
        lines.append(f"| {r.job} | {r.nodes} | {r.stage} | {len(r.records)} | {tps} | {iqr} | {step} | "
                     f"{r.seconds:.0f} | {_cell(r.state + (': ' + r.error if r.error else ''))} |")
    if result.validate_findings:
        lines += ["", "validate's findings (its own report: `shardstack validate`):", "",
                  *[f"- {_cell(f)}" for f in result.validate_findings]]
    lines += ["", "## Settings", "", "```", *_kv(dataclasses.asdict(result.settings)),
              *_kv(dataclasses.asdict(result.thresholds)), "```", ""]
    path = out / "acceptance.md"
    path.write_text("\n".join(lines))
    return path


def _kv(d: dict[str, Any]) -> list[str]:
    return [f"{k}: {v}" for k, v in d.items()]
