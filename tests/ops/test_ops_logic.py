"""The parts of the ops commands that interpret what nodes said: job state, step lines, validate findings."""

from __future__ import annotations

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops.demo import PROMPT, DemoResult, demo_job
from shardstack.ops.endpoint import Completion
from shardstack.ops.jobs.common import JobStatus, NodeJobState, check_job_name, parse_step_lines
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
