"""The slurm role's Python: the sacctmgr module's comparisons (what counts as a change) and the metrics
collector's rendering (checked by promtool)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROLE = Path(__file__).resolve().parents[2] / "roles" / "slurm"


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sacctmgr = _module(ROLE / "library" / "slurm_sacctmgr.py")
collector = _module(ROLE / "files" / "slurm_metrics.py")


@pytest.mark.parametrize("spec,minutes", [
    ("30", 30), ("30:01", 31), ("02:00:00", 120), ("1-00:00:00", 1440), ("3-12", 3 * 1440 + 720),
    ("1-02:03", 1440 + 123), ("", None), ("UNLIMITED", None), ("-1", None),
])
def test_wall_minutes(spec: str, minutes: int | None) -> None:
    assert sacctmgr.wall_minutes(spec) == minutes


def test_bad_specs_are_errors() -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        sacctmgr.wall_minutes("1:2:3:4")
    with pytest.raises(ValueError, match="not a TRES spec"):
        sacctmgr.tres_map("gres/gpu")


def test_unchanged_qos_as_sacctmgr_shows_it_is_no_change() -> None:
    declared = {"name": "high", "priority": 100, "max_tres_per_user": "gres/gpu=32,node=4", "max_jobs_per_user": 2,
                "max_wall": "1-00:00:00", "flags": ["DenyOnLimit"]}
    shown = {"priority": "100", "maxtrespu": "node=4,gres/gpu=32", "maxjobspu": "2", "maxwall": "1-00:00:00",
             "flags": "DenyOnLimit"}
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, declared, shown) == []


def test_qos_changes_set_only_what_differs_and_clear_undeclared_tres() -> None:
    declared = {"name": "normal", "priority": 10, "max_tres_per_user": "gres/gpu=16", "max_wall": "",
                "description": None}  # None: not managed
    shown = {"priority": "5", "maxtrespu": "gres/gpu=16,node=2", "maxwall": "3-00:00:00", "description": "x"}
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, declared, shown) == [
        "Priority=10", "MaxTRESPerUser=gres/gpu=16,node=-1", "MaxWall=-1"]


def test_a_qos_that_preempts_others_as_sacctmgr_shows_it() -> None:
    declared = {"name": "inference", "preempt": ["normal", "small"], "preempt_mode": "requeue"}
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, declared, {"preempt": "small,normal",
                                                                "preemptmode": "REQUEUE"}) == []
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, declared, {"preempt": "normal", "preemptmode": "cluster"}) == [
        "Preempt=normal,small", "PreemptMode=REQUEUE"]
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, {"preempt_mode": ""}, {"preemptmode": "REQUEUE"}) == [
        "PreemptMode=CLUSTER"]


def test_a_grace_time_in_seconds_as_sacctmgr_shows_it() -> None:
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, {"grace_time": 300}, {"gracetime": "00:05:00"}) == []
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, {"grace_time": 90000}, {"gracetime": "1-01:00:00"}) == []
    assert sacctmgr.differences(sacctmgr.QOS_FIELDS, {"grace_time": 300}, {"gracetime": "00:00:00"}) == [
        "GraceTime=300"]
    with pytest.raises(ValueError, match=r"not a number of seconds: '5m' \(e.g. grace_time: 300\)"):
        sacctmgr.differences(sacctmgr.QOS_FIELDS, {"grace_time": "5m"}, {"gracetime": "00:00:00"})


def test_a_description_with_an_apostrophe_as_sacctmgr_stores_it_is_no_change() -> None:
    declared = {"description": "the inference tier's replicas"}
    assert sacctmgr.differences(sacctmgr.ACCOUNT_FIELDS, declared, {"descr": "the inference tier`s replicas"}) == []
    assert sacctmgr.differences(sacctmgr.ACCOUNT_FIELDS, declared, {"descr": "other"}) == [
        "Description=the inference tier's replicas"]


def test_new_account_association_and_admin_level_names() -> None:
    declared = {"parent": "root", "fairshare": 60, "qos": ["normal", "high"], "default_qos": "normal"}
    assert sacctmgr.differences(sacctmgr.ACCOUNT_ASSOC_FIELDS, declared, None) == [
        "Parent=root", "Fairshare=60", "QOS=normal,high", "DefaultQOS=normal"]
    shown = {"parentname": "root", "fairshare": "60", "qos": "high,normal", "defaultqos": "normal"}
    assert sacctmgr.differences(sacctmgr.ACCOUNT_ASSOC_FIELDS, declared, shown) == []
    assert sacctmgr.differences(sacctmgr.USER_FIELDS, {"admin_level": "admin"}, {"adminlevel": "Administrator"}) == []


NODES = (
    "NodeName=gpu01 Arch=x86_64 CoresPerSocket=16 CPUAlloc=32 CPUTot=64 CfgTRES=cpu=64,mem=500000M,billing=64,"
    "gres/gpu=8 AllocTRES=cpu=32,gres/gpu=4 State=MIXED Reason=none\n"
    "NodeName=gpu02 CPUAlloc=0 CPUTot=64 CfgTRES=cpu=64,gres/gpu=8 AllocTRES= State=DOWN+NOT_RESPONDING "
    "Reason=Not responding [slurm@2026-12-01T09:00:00]\n"
    "NodeName=gpu03 CPUAlloc=0 CPUTot=64 CfgTRES=cpu=64,gres/gpu=8 AllocTRES= State=IDLE+DRAIN Reason=disk\n"
)
JOBS = "RUNNING|train|None\nPENDING|train|Priority\nPENDING|train|QOSMaxGRESPerUser\nPENDING|train|Priority\n"


def test_node_states_named_as_sinfo_names_them() -> None:
    assert collector.node_state("MIXED") == ("mixed", True)
    assert collector.node_state("DOWN+NOT_RESPONDING") == ("down", False)
    assert collector.node_state("IDLE+DRAIN") == ("drained", True)
    assert collector.node_state("ALLOCATED+DRAIN") == ("draining", True)
    assert collector.node_state("IDLE*") == ("idle", False)


def test_metrics_textfile() -> None:
    text = collector.render(NODES, JOBS, 1764579600.0)
    lines = set(text.splitlines())
    assert 'slurm_node_state{slurm_node="gpu01",state="mixed",reason="none"} 1' in lines
    assert 'slurm_node_state{slurm_node="gpu02",state="down",reason="Not responding [slurm@2026-12-01T09:00:00]"} 1' \
        in lines
    assert 'slurm_node_state{slurm_node="gpu03",state="drained",reason="disk"} 1' in lines
    assert 'slurm_node_responding{slurm_node="gpu02"} 0' in lines
    assert {'slurm_node_gpus{slurm_node="gpu01",state="total"} 8',
            'slurm_node_gpus{slurm_node="gpu01",state="alloc"} 4',
            'slurm_node_cpus{slurm_node="gpu01",state="alloc"} 32'} <= lines
    assert {'slurm_queue_jobs{state="pending",partition="train"} 3',
            'slurm_queue_pending_jobs{reason="Priority"} 2',
            'slurm_queue_pending_jobs{reason="QOSMaxGRESPerUser"} 1', "slurm_scrape_success 1"} <= lines
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install prometheus"
    for body in (text, collector.failed(1764579600.0)):
        proc = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
