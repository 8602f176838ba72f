"""Alert and recording rules: promtool checks them, promtool unit tests exercise every alert both ways, and the
tests demonstrably catch the DCGM traps (a rule rewritten the naive way fails them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from .conftest import RULE_TESTS_DIR, RULES_DIR, run, tool

RULE_FILES = sorted(RULES_DIR.glob("*.rules.yml"))
TEST_FILES = sorted(RULE_TESTS_DIR.glob("*.test.yml"))

# The alerts issue 7 asks for, by the names the docs use.
REQUIRED_ALERTS = {
    "NodeDown", "ExporterDown", "GPUUnderutilized", "TrainingStalled", "TrainingHungGPUBusy", "GPUMemoryNearFull",
    "XidError", "GPUUncorrectableECCError", "GPURowRemapPending", "GPURowRemapFailure", "GPUNVLinkErrors",
    "GPUPCIeReplayErrors", "IBPortDown", "CheckpointStorageFull", "InferenceHighErrorRate", "InferenceP99High",
    "InferenceQueueBacklog", "Watchdog",
}


def _rules(path: Path) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def _alerts() -> dict[str, dict]:
    return {r["alert"]: r for p in RULE_FILES for r in _rules(p) if "alert" in r}


def test_rule_and_test_files_exist() -> None:
    assert RULE_FILES and TEST_FILES
    tested = {(RULE_TESTS_DIR / f).resolve() for t in TEST_FILES for f in yaml.safe_load(t.read_text())["rule_files"]}
    assert set(RULE_FILES) <= tested, f"rule files without unit tests: {sorted(set(RULE_FILES) - tested)}"


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    proc = run(tool("promtool"), "check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(path: Path) -> None:
    proc = run(tool("promtool"), "test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_required_alerts_exist_with_severity_and_summary() -> None:
    alerts = _alerts()
    assert set(alerts) >= REQUIRED_ALERTS, f"missing alerts: {sorted(REQUIRED_ALERTS - set(alerts))}"
    for name, rule in alerts.items():
        assert rule.get("labels", {}).get("severity") in {"critical", "warning", "none"}, name
        assert rule.get("annotations", {}).get("summary"), name


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = set(_alerts()) - {"Watchdog"}  # Watchdog must always fire: it has no silent case by design.
    assert alerts <= fires, f"alerts never shown firing: {sorted(alerts - fires)}"
    assert alerts <= silent, f"alerts never shown silent: {sorted(alerts - silent)}"
    assert "Watchdog" in fires


def _mutated(tmp_path: Path, rule_file: str, old: str, new: str, test_file: str) -> str:
    """Copy the rules with one expression rewritten, point the unit test at the copy, run it."""
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    for p in RULE_FILES:
        (rules_dir / p.name).write_text(p.read_text())
    target = rules_dir / rule_file
    text = target.read_text()
    assert old in text, f"{old!r} not in {rule_file}: the mutation no longer applies"
    target.write_text(text.replace(old, new))
    test = yaml.safe_load((RULE_TESTS_DIR / test_file).read_text())
    test["rule_files"] = [str(rules_dir / Path(f).name) for f in test["rule_files"]]
    test_path = tmp_path / test_file
    test_path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = run(tool("promtool"), "test", "rules", str(test_path))
    assert proc.returncode != 0, f"the naive rule passed the unit tests:\n{proc.stdout}"
    return proc.stdout + proc.stderr


def test_memory_ratio_without_reserved_fails_the_tests(tmp_path: Path) -> None:
    out = _mutated(tmp_path, "gpu.rules.yml", " + DCGM_FI_DEV_FB_RESERVED", "", "gpu.test.yml")
    assert "GPUMemoryNearFull" in out


def test_xid_alert_on_the_held_value_fails_the_tests(tmp_path: Path) -> None:
    rules = (RULES_DIR / "gpu.rules.yml").read_text()
    windowed = re.search(r"- alert: XidError\n        expr: \|\n(.*?)\n        labels:", rules, re.S)
    assert windowed
    out = _mutated(tmp_path, "gpu.rules.yml", windowed.group(1), "          DCGM_FI_DEV_XID_ERRORS > 0",
                   "gpu.test.yml")
    assert "XidError" in out


def test_stall_detection_by_gpu_utilisation_alone_fails_the_tests(tmp_path: Path) -> None:
    # "GPUs are busy, so training is fine": the NCCL-deadlock case must catch this.
    out = _mutated(tmp_path, "training.rules.yml", "time() - shardstack_train_last_step_timestamp_seconds > 600",
                   "time() - shardstack_train_last_step_timestamp_seconds > 600 "
                   "unless on () max(shardstack:gpu_utilization:ratio) > 0.9", "training.test.yml")
    assert "TrainingStalled" in out


def test_dcgm_fields_used_by_rules_and_dashboards_are_exported() -> None:
    """The dcgm_exporter role's counters file must carry every DCGM field the rules and dashboards read."""
    from .conftest import DASHBOARDS_DIR, ROLES

    defaults = yaml.safe_load((ROLES / "dcgm_exporter" / "defaults" / "main.yml").read_text())
    exported = {c["field"] for c in defaults["dcgm_exporter_counters"]}
    sources = [*RULE_FILES, *DASHBOARDS_DIR.glob("*.json")]
    used = {m for p in sources for m in re.findall(r"\bDCGM_FI_[A-Z0-9_]+", p.read_text())}
    assert used, "no DCGM fields found: the pattern is wrong"
    assert used <= exported, f"read but not exported: {sorted(used - exported)}"
