"""The parts of the ops commands that interpret what nodes said: job state, step lines, validate findings."""

from __future__ import annotations

import pytest
from shardstack.errors import ShardstackError
from shardstack.node.allreduce import busbw_floor, sizes
from shardstack.ops.demo import PROMPT, DemoResult, demo_job
from shardstack.ops.endpoint import Completion
from shardstack.ops.jobs.common import JobStatus, NodeJobState, check_job_name, parse_step_lines, step_records
from shardstack.ops.jobs.systemd import state_of
from shardstack.ops.validate import validate_findings


def node(active: str, result: str = "success", step: int | None = None) -> NodeJobState:
    return NodeJobState("n", active, "", result, 0, "", {"step": step, "loss": 1.0} if step else None)


@pytest.mark.parametrize(("states", "want"), [
    ([node("active"), node("active")], "running"),
    ([node("inactive"), node("active")], "running"),
    ([node("inactive"), node("inactive")], "finished"),
    ([node("inactive", "exit-code"), node("inactive")], "stopped"),
    ([node("failed", "exit-code"), node("active")], "failed"),
    ([], "unknown"),
])
def test_job_state_from_the_nodes(states: list[NodeJobState], want: str) -> None:
    assert state_of(states) == want


def test_newest_step_across_nodes() -> None:
    st = JobStatus("j", "running", [node("active", step=40), node("active"), node("active", step=45)])
    assert st.last_step == {"step": 45, "loss": 1.0}


def test_step_lines_in_a_journal() -> None:
    journal = "\n".join([
        'host shardstack-train-j[1]: {"step": 10, "loss": 3.5, "tokens_per_second": 100.0}',
        "host shardstack-train-j[1]: INFO shardstack.trainer: step 10/20 loss 3.5",
        'host shardstack-train-j[1]: {"step": 20, "loss": 3.1, "tokens_per_second": 110.0}',
        'host shardstack-train-j[1]: {"not": "a step"}',
        "host shardstack-train-j[1]: {broken json",
    ])
    assert parse_step_lines(journal) == {"step": 20, "loss": 3.1, "tokens_per_second": 110.0}
    assert parse_step_lines("nothing here") is None
    assert [(r["step"], r["loss"]) for r in step_records(journal)] == [(10, 3.5), (20, 3.1)]
    assert step_records("") == []


@pytest.mark.parametrize("name", ["ok", "run-1", "a_b", "x" * 63])
def test_good_job_names(name: str) -> None:
    assert check_job_name(name) == name


@pytest.mark.parametrize("name", ["", "Bad", "-lead", "a b", "x" * 64, "../etc"])
def test_bad_job_names(name: str) -> None:
    with pytest.raises(ShardstackError):
        check_job_name(name)


CPU_NODE = {"accel": {"facts": {"torch_version": "2.13.0+cpu"}, "accelerator": "cpu"}, "train_node": True}
GOOD = {
    "validate_gpu": {"n1": CPU_NODE},
    "validate_allreduce": {"correct": True, "backend": "gloo"},
    "validate_storage": {"n1": {"peer_checksum_matches": True, "read_of": "n2"}},
    "validate_inference": {"status": 200},
}


def test_validate_passes_only_with_every_check() -> None:
    assert validate_findings(GOOD) == []
    assert validate_findings({}) == ["gpu: no result", "all-reduce: no result", "storage: no result",
                                     "inference: no result"]
    assert validate_findings({**GOOD, "validate_allreduce": {"correct": False}}) == ["all-reduce: wrong sum"]
    bad_storage = {"n1": {"peer_checksum_matches": False, "read_of": "n2"}}
    assert validate_findings({**GOOD, "validate_storage": bad_storage}) == [
        "storage: n1 read different bytes than n2 wrote"]
    assert validate_findings({**GOOD, "validate_inference": {"status": 503}}) == [
        "inference: load balancer answered 503"]
    tls = "Request failed: <urlopen error [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed>"
    assert validate_findings({**GOOD, "validate_inference": {"status": -1, "text": tls}}) == [
        f"inference: load balancer answered -1: {tls}"]


def test_demo_job_is_a_valid_stage3_config() -> None:
    job = demo_job(300, "/srv/shardstack")
    assert job["engine"]["stage"] == 3 and job["schedule"]["total_steps"] == 300
    assert job["checkpoint"]["dir"] == "/srv/shardstack/checkpoints/demo"
    assert job["data"]["path"].startswith("/srv/shardstack/")


def test_demo_job_fine_tunes_a_model_on_shared_storage() -> None:
    model = "/srv/shardstack/pretrained/stdlib-llama-0123456789ab"
    job = demo_job(60, "/srv/shardstack", init_from=model)
    assert job["model"]["init_from"] == model and job["data"]["tokenizer"] == model
    # Data prepared with another tokenizer must not be reused: the directory is named after the model.
    assert job["data"]["path"] == "/srv/shardstack/data/corpus-stdlib-llama-0123456789ab"
    assert job["engine"]["stage"] == 3 and job["optimizer"]["lr"] < demo_job(60, "/srv/shardstack")["optimizer"]["lr"]


def test_the_demo_outcome_is_what_demo_json_prints() -> None:
    """`shardstack demo --json`: phases with seconds, the completion, the error (also when a phase failed)."""
    done = DemoResult("demo", [("lab up (3 nodes)", 12.34), ("site.yml", 80.06)], Completion(200, 0.25, " value", {}))
    assert done.to_dict() == {"name": "demo", "ok": True, "error": None,
                              "phases": [{"phase": "lab up (3 nodes)", "seconds": 12.3},
                                         {"phase": "site.yml", "seconds": 80.1}],
                              "completion": {"prompt": PROMPT, "text": " value", "seconds": 0.25}}
    failed = DemoResult("demo", [("lab up (3 nodes)", 1.0)], error="train submit failed").to_dict()
    assert (failed["ok"], failed["error"], failed["completion"]) == (False, "train submit failed", None)


def test_the_all_reduce_sweep_doubles_from_1_mib_to_the_largest_size() -> None:
    assert sizes(16) == [2**20 * k for k in (1, 2, 4, 8, 16)]
    assert sizes(8192)[-1] == 8 * 2**30 and len(sizes(8192)) == 14  # nccl-tests' 1M → 8G
    assert sizes(3) == [2**20, 2**21, 3 * 2**20]  # the largest is always measured, even off the doubling
    assert sizes(0.5) == [2**19]


@pytest.mark.parametrize(("text", "floor"), [("auto", None), ("0", 0.0), ("2.5", 2.5)])
def test_the_bus_bandwidth_floor_setting(text: str, floor: float | None) -> None:
    assert busbw_floor(text) == floor


@pytest.mark.parametrize("text", ["-1", "fast", "nan", ""])
def test_a_bad_bus_bandwidth_floor_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="want `auto` or Gbit/s"):
        busbw_floor(text)


def test_an_all_reduce_below_its_floor_is_a_finding() -> None:
    slow = {"correct": True, "backend": "gloo", "bytes": 16 * 2**20, "world_size": 2, "busbw_gbps": 0.41,
            "busbw_min_gbps": 1.0, "below_floor": True}
    assert validate_findings({**GOOD, "validate_allreduce": slow}) == [
        "all-reduce: bus bandwidth 0.41 Gbit/s at 16 MiB over 2 rank(s) on gloo is below the floor of 1 Gbit/s "
        "(validate_allreduce_busbw_min)"]
    assert validate_findings({**GOOD, "validate_allreduce": {**slow, "below_floor": False}}) == []
