"""The first day on a real cluster (issue 28): `model put`, `data put`, `data prepare --cluster`, `serve publish
JOB[@STEP]` and the checks `train submit` makes before anything runs. The parts that need no cluster are tested as
functions; the rest runs for real through ansible-runner on this machine (a local "train node" whose shared
directory is a tmp dir, the job account root, `shardstack` this venv's or a stand-in that records its argv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shardstack.errors import ShardstackError
from shardstack.ops import serve as serve_ops
from shardstack.ops import storage
from shardstack.ops import train as train_ops
from shardstack.ops.demo import demo_job
from shardstack.ops.inventory import Cluster

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent


def shardstack(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTACK_INVENTORY"}
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, timeout=180,
                          cwd=cwd, env=env)


def _one_line_usage_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("shardstack: error: ") or proc.stderr.startswith("usage: "), proc.stderr


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """(inventory, shared dir): one local train node; `su` to become (root here, no sudo), the job account root."""
    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {
        "hosts": {"h1": {}},
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "ansible_become_method": "su", "shardstack_shared_dir": str(shared),
                 "training_runtime_user": "root", "training_runtime_venv": str(VENV),
                 "training_runtime_jobs_dir": str(tmp_path / "jobs"), "shardstack_scheduler": "systemd"},
        "children": {"train_nodes": {"hosts": {"h1": {}}}},
    }}))
    return inv, shared


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="becomes root on this machine (su) like on a node")


# Arguments ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["model", "put"], ["data", "put"], ["data", "prepare"], ["serve", "publish"]])
def test_help_works(argv: list[str]) -> None:
    proc = shardstack(*argv, "--help")
    assert proc.returncode == 0 and "usage: shardstack" in proc.stdout, proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["model", "put"], "the following arguments are required: dir"),
    (["model", "put", "{here}", "-i", "{inv}"], "is not a model directory (no config.json)"),
    (["model", "put", "{model}", "--name", "../up", "-i", "{inv}"], "model name '../up' is not valid"),
    (["data", "put", "{here}/nope.txt", "-i", "{inv}"], "nope.txt does not exist"),
    (["data", "put", "{text}", "--name", ".hidden", "-i", "{inv}"], "data name '.hidden' is not valid"),
    (["data", "prepare", "--cluster", "{text}", "-i", "{inv}"], "needs --out-name NAME"),
    (["data", "prepare", "--cluster", "--out-name", "c", "-i", "{inv}"], "needs INPUT"),
    (["data", "prepare", "--cluster", "{text}", "--out", "x", "--out-name", "c"], "pass --out-name NAME, not --out"),
    (["data", "prepare", "--cluster", "{text}", "--out-name", "a/b", "-i", "{inv}"], "--out-name 'a/b' is not valid"),
    (["data", "prepare", "--cluster", "/elsewhere/c.txt", "--out-name", "c", "-i", "{inv}"],
     "input /elsewhere/c.txt is neither a file here nor a path under the shared directory"),
    (["data", "prepare", "--cluster", "{text}", "--out-name", "c", "--tokenizer", "/opt/tok", "-i", "{inv}"],
     "--tokenizer /opt/tok is not under the shared directory"),
    (["data", "prepare", "{text}"], "data prepare needs --out DIR"),
    (["data", "prepare", "{text}", "--out", "x", "--out-name", "c"], "--out-name and -i are options of --cluster"),
    (["serve", "publish"], "the following arguments are required: JOB[@STEP]"),
    (["serve", "publish", "Run1", "-i", "{inv}"], "'Run1' is not JOB or JOB@STEP"),
    (["serve", "publish", "run1@", "-i", "{inv}"], "'run1@' is not JOB or JOB@STEP"),
])
def test_bad_input_is_exit_2_and_one_line(argv: list[str], needle: str, tmp_path: Path,
                                          node: tuple[Path, Path]) -> None:
    inv, _shared = node
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    text = tmp_path / "c.txt"
    text.write_text("some text\n")
    subs = {"{here}": str(tmp_path), "{inv}": str(inv), "{model}": str(model), "{text}": str(text)}
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    _one_line_usage_error(shardstack(*argv, cwd=tmp_path), needle)


@pytest.mark.parametrize("text, want", [
    ("run1", ("run1", None)), ("run1@1200", ("run1", 1200)), ("e2e@0", ("e2e", 0)),
    ("a_b-c@00000060", ("a_b-c", 60)),
])
def test_job_refs(text: str, want: tuple[str, int | None]) -> None:
    assert serve_ops.parse_job_ref(text) == want


@pytest.mark.parametrize("text", ["", "@5", "run1@", "run1@x", "run1@-1", "Run1", "run1@5@6", "run/1", "-run",
                                  "run1@123456789", "a" * 64])
def test_bad_job_refs(text: str) -> None:
    with pytest.raises(ShardstackError, match="is not JOB or JOB@STEP"):
        serve_ops.parse_job_ref(text)


def test_publish_names_and_the_newest_valid_step() -> None:
    assert serve_ops.step_dir("/srv/s/checkpoints/run1/", 60) == "/srv/s/checkpoints/run1/step_00000060"
    assert serve_ops.export_name("run1", 60) == "run1-step_00000060"
    listing = {"checkpoints": [{"step": 40, "valid": True}, {"step": 60, "valid": False},
                               {"step": 50, "valid": True}], "quarantined": []}
    assert serve_ops.pick_newest_valid(listing, "/c") == 50
    with pytest.raises(ShardstackError, match="no valid checkpoint under /c"):
        serve_ops.pick_newest_valid({"checkpoints": [{"step": 60, "valid": False}]}, "/c")


# Paths train submit accepts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, ok", [
    ("/srv/shardstack/data/corpus", True), ("/srv/shardstack/checkpoints/a/../b", True),
    ("/srv/shardstack", False), ("/srv/shardstack-other/data", False), ("/srv/shardstack/../etc", False),
    ("data/corpus", False), ("/data/corpus", False),
])
def test_on_shared(path: str, ok: bool) -> None:
    assert storage.on_shared(path, "/srv/shardstack") is ok
    assert storage.on_shared(path, "/srv/shardstack/") is ok


@pytest.mark.parametrize("key, config", [
    ("data.path", {"data": {"path": "/home/me/corpus"}}),
    ("checkpoint.dir", {"data": {"path": "/srv/shardstack/data/c"}, "checkpoint": {"dir": "ckpt"}}),
    ("model.init_from", {"model": {"init_from": "/opt/models/llama"}}),
    ("checkpoint.resume", {"checkpoint": {"resume": "/tmp/step_00000010"}}),
])
def test_submit_refuses_paths_off_shared_storage(key: str, config: dict) -> None:
    with pytest.raises(ShardstackError, match=rf"^{key} \S+ is not under the shared directory /srv/shardstack\n"):
        train_ops.check_shared_paths(config, "/srv/shardstack")


def test_submit_accepts_paths_on_shared_storage() -> None:
    config = {"data": {"path": "/srv/shardstack/data/c"}, "model": {"init_from": "/srv/shardstack/pretrained/m"},
              "checkpoint": {"dir": "/srv/shardstack/checkpoints/j", "resume": "auto"}}
    train_ops.check_shared_paths(config, "/srv/shardstack")
    assert [k for k, _ in train_ops.shared_paths(config)] == ["data.path", "checkpoint.dir", "model.init_from"]
    train_ops.check_shared_paths(demo_job(60, "/srv/shardstack",
                                                    init_from="/srv/shardstack/pretrained/m"), "/srv/shardstack")


# Checksums ----------------------------------------------------------------------------------------------------------

def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_checksums_name_a_missing_and_a_different_file(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", {"config.json": b"{}", "sub/w.bin": b"\0" * 10, "tok.json": b"t"})
    copy = _tree(tmp_path / "copy", {"config.json": b"{}", "sub/w.bin": b"\1" * 10, "old.bin": b"o"})
    out = subprocess.run(storage.checksum_argv(str(copy)), capture_output=True, text=True, check=True).stdout
    remote = storage.parse_checksums(out)
    assert set(remote) == {"config.json", "sub/w.bin", "old.bin"}
    local = storage.local_checksums(src)
    with pytest.raises(ShardstackError, match=r"does not match the source: missing on the node: tok\.json; sha256 "
                                              r"differs: sub/w\.bin\n"):
        storage.compare_checksums(local, remote, "h1:/x")
    (copy / "tok.json").write_bytes(b"t")
    (copy / "sub/w.bin").write_bytes(b"\0" * 10)
    again = storage.parse_checksums(subprocess.run(storage.checksum_argv(str(copy)), capture_output=True, text=True,
                                                   check=True).stdout)
    assert storage.compare_checksums(local, again, "h1:/x") == ["old.bin"]  # extra: reported, not an error
    one = tmp_path / "c.txt"
    one.write_text("x")
    assert list(storage.local_checksums(one)) == ["c.txt"]  # a file lands in the directory under its own name


# On a local node ----------------------------------------------------------------------------------------------------

@needs_root
def test_model_put_copies_and_verifies(tmp_path: Path, node: tuple[Path, Path]) -> None:
    inv, shared = node
    model = _tree(tmp_path / "stdlib-llama-x", {"config.json": b"{}", "model.safetensors": os.urandom(4096),
                                                "tokenizer.json": b"{}"})
    proc = shardstack("model", "put", str(model), "--name", "llama", "-i", str(inv), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == {"path": f"{shared}/pretrained/llama", "files": 3, "bytes": 4100, "extra": []}
    assert (shared / "pretrained/llama/model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    # A copy that went wrong on the node is found, by name.
    (shared / "pretrained/llama/tokenizer.json").write_text("changed")
    with pytest.raises(ShardstackError, match=r"sha256 differs: tokenizer\.json"):
        storage.verify_copy(Cluster.load(inv), "h1", model, f"{shared}/pretrained/llama")


@needs_root
def test_data_put_and_prepare_on_the_cluster(tmp_path: Path, node: tuple[Path, Path]) -> None:
    inv, shared = node
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    put = shardstack("data", "put", str(text), "-i", str(inv), "--json")
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout)["path"] == f"{shared}/data/corpus"
    assert (shared / "data/corpus/corpus.txt").read_text() == text.read_text()
    # From shared storage: `shardstack data prepare` on the node, as the job account.
    prep = shardstack("data", "prepare", "--cluster", f"{shared}/data/corpus", "--out-name", "tokens",
                      "--workers", "1", "-i", str(inv), "--json")
    assert prep.returncode == 0, prep.stderr
    doc = json.loads(prep.stdout)
    assert doc["out"] == f"{shared}/data/tokens" and doc["total_tokens"] == 50 * 44 and doc["copied"] is None
    assert (shared / "data/tokens/meta.json").is_file()
    # A file here is put first (next to the output, verified), then prepared from there.
    local = storage.prepare_on_cluster(Cluster.load(inv), str(text), "local", workers=1)
    assert local.copied is not None and local.source == f"{shared}/data/local-text/corpus.txt"
    assert local.meta["total_tokens"] == 50 * 44


def test_prepare_runs_shardstack_as_the_job_account() -> None:
    argv = storage.prepare_argv("/opt/shardstack/venv", "shardstack", "/srv/s/data/raw", "/srv/s/data/tok",
                                tokenizer="/srv/s/pretrained/m", workers=4)
    assert argv == ["runuser", "-u", "shardstack", "--", "/opt/shardstack/venv/bin/shardstack", "data", "prepare",
                    "/srv/s/data/raw", "--out", "/srv/s/data/tok", "--tokenizer", "/srv/s/pretrained/m", "--json",
                    "--workers", "4"]
    assert storage.export_argv("/v", "/c/step_00000060", "/e/j") == [
        "/v/bin/shardstack", "export", "--checkpoint", "/c/step_00000060", "--out", "/e/j", "--format", "shardstack"]
    assert storage.export_argv("/v", "/c", "/e/j", key_file="/k")[-2:] == ["--key-file", "/k"]
    assert storage.export_argv("/v", "/c", "/e/j", key_file="/k", allow_unsigned=True)[-1] == "--allow-unsigned"
    assert storage.export_argv("/v", "/c", "/e/j", fmt="hf")[-2:] == ["--format", "hf"]


def test_the_export_for_the_inference_tier_is_a_hugging_face_directory_once_a_node_runs_vllm() -> None:
    """vLLM loads Hugging Face directories only; the built-in engine loads both, so one vLLM node decides."""
    groups = {"inference_nodes": ["n2", "n3"]}
    builtin = Cluster(Path("hosts.yml"), groups, {"n2": {}, "n3": {"inference_service_engine": "builtin"}})
    mixed = Cluster(Path("hosts.yml"), groups, {"n2": {}, "n3": {"inference_service_engine": "vllm"}})
    assert storage.serving_format(builtin) == "shardstack"
    assert storage.serving_format(mixed) == "hf"
    assert storage.serving_format(Cluster(Path("hosts.yml"), {}, {})) == "shardstack"
    assert mixed.host_setting("inference_service_engine", "inference_service", "n2") == "builtin"  # role default


@needs_root
def test_submit_refuses_a_data_path_without_a_prepared_data_set(tmp_path: Path, node: tuple[Path, Path]) -> None:
    inv, shared = node
    config = {"data": {"path": f"{shared}/data/nothing"}, "model": {"init_from": f"{shared}/pretrained/m"},
              "checkpoint": {"dir": f"{shared}/checkpoints/j"}}
    with pytest.raises(ShardstackError, match=rf"^data.path {shared}/data/nothing holds no prepared data set"):
        train_ops.submit(config, "j", Cluster.load(inv))
    _tree(shared / "data/nothing", {"meta.json": b"{}"})
    with pytest.raises(ShardstackError, match=rf"^model.init_from {shared}/pretrained/m is not a model directory"):
        train_ops.check_inputs(config, Cluster.load(inv), "h1")
    _tree(shared / "pretrained/m", {"config.json": b"{}"})
    train_ops.check_inputs(config, Cluster.load(inv), "h1")  # both there: nothing to say
    # The CLI: one line, exit 2, nothing submitted.
    job = tmp_path / "j.yaml"
    job.write_text(json.dumps({"data": {"path": f"{shared}/data/other"}, "model": {"size": "tiny"},
                               "checkpoint": {"dir": f"{shared}/checkpoints/j"}}))
    proc = shardstack("train", "submit", "--config", str(job), "-i", str(inv))
    _one_line_usage_error(proc, f"data.path {shared}/data/other holds no prepared data set on the cluster")
    assert "shardstack data put" in proc.stderr and "data prepare --cluster" in proc.stderr


def test_missing_argv_prints_only_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "there").write_text("")
    argv = train_ops.missing_argv([str(tmp_path / "there"), str(tmp_path / "not there"), "/nope/$(x)"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [str(tmp_path / "not there"), "/nope/$(x)"]


# serve publish, with a stand-in `shardstack` on the node --------------------------------------------------------------

FAKE = """#!/bin/sh
printf '%s\\n' "$*" >> "{log}"
case "$1" in
  checkpoint) printf '%s\\n' '{{"checkpoints": [{{"step": 40, "valid": true}}, {{"step": 60, "valid": false}}]}}' ;;
  export) mkdir -p "$5" && echo "exported step $(expr "${{3##*step_}}" + 0): 3 tensors" ;;
esac
"""


@needs_root
@pytest.mark.parametrize("ref, step, signed", [("run1", 40, True), ("run1@60", 60, True), ("unsigned@7", 7, False)])
def test_publish_exports_on_the_node_and_switches_current(ref: str, step: int, signed: bool, tmp_path: Path,
                                                          node: tuple[Path, Path]) -> None:
    inv, shared = node
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "argv.log"
    fake = venv / "bin" / "shardstack"
    fake.write_text(FAKE.format(log=log))
    fake.chmod(0o755)
    data = json.loads(inv.read_text())
    data["all"]["vars"]["training_runtime_venv"] = str(venv)
    inv.write_text(json.dumps(data))
    (shared / "exports").mkdir()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    job = ref.split("@")[0]
    (jobs / f"{job}.yaml").write_text(json.dumps({"name": job, "checkpoint": {
        "dir": f"{shared}/checkpoints/{job}", "signing_key_file": "/etc/k.key", "require_signature": signed}}))

    proc = shardstack("serve", "publish", ref, "--no-rollout", "-i", str(inv), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    name = f"{job}-step_{step:08d}"
    assert doc == {"job": job, "step": step, "host": "h1", "path": f"{shared}/exports/{name}",
                   "current": f"{shared}/exports/current", "signed": signed, "rollout": None}
    assert os.readlink(shared / "exports" / "current") == name
    key = ["--key-file", "/etc/k.key"] if signed else ["--allow-unsigned"]
    ran = log.read_text().splitlines()
    export = " ".join(["export", "--checkpoint", f"{shared}/checkpoints/{job}/step_{step:08d}", "--out",
                       f"{shared}/exports/{name}", "--format", "shardstack", *key])  # no vLLM node: ours
    assert ran[-1] == export
    if "@" not in ref:  # the newest valid checkpoint, as `checkpoint ls` reports it, was asked for first
        assert ran == [" ".join(["checkpoint", "ls", f"{shared}/checkpoints/{job}", "--json", *key]), export]


@needs_root
def test_publish_of_an_unknown_job_is_one_line(node: tuple[Path, Path], tmp_path: Path) -> None:
    inv, _shared = node
    proc = shardstack("serve", "publish", "nojob", "-i", str(inv))
    assert proc.returncode == 2 and "no job nojob on h1: cannot read" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_jobs_may_live_in_a_directory_of_their_own_on_the_shared_storage() -> None:
    """training_runtime_shared_dir set in the inventory (the Slurm scenario's /mnt/lab-shared/molecule-slurm) is
    where submit expects a job's paths; unset, the shared directory is."""
    inv = Cluster(Path("hosts.yml"), {"train_nodes": ["n1"]}, {"n1": {"training_runtime_shared_dir": "/mnt/jobs"}})
    assert train_ops.job_shared_dir(inv) == "/mnt/jobs"
    train_ops.check_shared_paths(demo_job(10, "/mnt/jobs", "j"), train_ops.job_shared_dir(inv))
    plain = Cluster(Path("hosts.yml"), {"train_nodes": ["n1"]}, {"n1": {}})
    assert train_ops.job_shared_dir(plain) == "/srv/shardstack"
    with pytest.raises(ShardstackError, match="is not under the shared directory /srv/shardstack"):
        train_ops.check_shared_paths(demo_job(10, "/mnt/jobs", "j"), train_ops.job_shared_dir(plain))
