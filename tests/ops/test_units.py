"""The systemd units the roles write: valid for systemd, hardened as docs/design.md says, and their ExecStart
lines accepted by the real command-line parsers (torchrun's and shardstack's), so a renamed flag fails here."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from shardstack.cli import build_parser

from .conftest import render

TRAIN_VARS = {"__training_runtime_nproc": 1, "__training_runtime_ifname": "eth0"}


def unit_sections(text: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(text.replace("\\\n", " "))
    return cp


def compile_caches(text: str) -> tuple[str, str]:
    """(vLLM's, Inductor's) cache directories from the unit's Environment= lines."""
    env = dict(kv.split("=", 1) for line in text.splitlines() if line.startswith("Environment=")
               for kv in line.removeprefix("Environment=").split())
    return env["VLLM_CACHE_ROOT"], env["TORCHINDUCTOR_CACHE_DIR"]


def exec_argv(text: str) -> list[str]:
    return shlex.split(unit_sections(text)["Service"]["ExecStart"])


@pytest.fixture
def inference_unit() -> str:
    return render("inference_service", "shardstack-inference.service.j2", inventory_hostname="n2",
                  ansible_host="10.0.0.2")


@pytest.fixture
def train_unit() -> str:
    return render("training_runtime", "shardstack-train@.service.j2", **TRAIN_VARS)


def test_inference_unit_is_hardened_notify_and_non_root(inference_unit: str) -> None:
    assert inference_unit.startswith("#")  # ansible_managed comment first
    svc = unit_sections(inference_unit)["Service"]
    assert svc["Type"] == "notify"
    assert svc["User"] == "shardstack" and svc["Group"] == "shardstack"
    assert int(svc["WatchdogSec"]) >= 5
    for key, want in {"NoNewPrivileges": "true", "ProtectSystem": "strict", "PrivateTmp": "true",
                      "ProtectHome": "true", "CapabilityBoundingSet": ""}.items():
        assert svc[key] == want, key
    # docs/design.md (serving): these two break the GPU and PyTorch.
    assert "PrivateDevices" not in svc and "MemoryDenyWriteExecute" not in svc
    # SIGTERM drains for drain_seconds; systemd must wait longer than that before SIGKILL.
    assert int(svc["TimeoutStopSec"]) > 20


def test_inference_execstart_is_a_valid_shardstack_serve_command(inference_unit: str) -> None:
    argv = exec_argv(inference_unit)
    assert argv[0] == "/opt/shardstack/venv/bin/shardstack"
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.command == "serve"
    assert str(args.model) == "/srv/shardstack/exports/current"
    # The node's cluster address, never a wildcard: clients cannot bypass the load balancer.
    assert args.port == 8000 and args.host == "10.0.0.2"
    assert args.stall_seconds == 30 and args.drain_seconds == 20
    # The engine's memory from the role: the model's context unless inference_service_context bounds it.
    assert args.context is None and args.max_prefill_tokens == 4096
    bounded = render("inference_service", "shardstack-inference.service.j2", inventory_hostname="n2",
                     ansible_host="10.0.0.2", inference_service_context=8192, inference_service_max_prefill_tokens=512)
    args = build_parser(exec_argv(bounded)[1:]).parse_args(exec_argv(bounded)[1:])
    assert (args.context, args.max_prefill_tokens) == (8192, 512)


def test_the_token_reaches_the_service_as_a_systemd_credential(inference_unit: str) -> None:
    # systemd (root) reads the root-only file and hands the service its own copy in $CREDENTIALS_DIRECTORY (%d);
    # the file itself is never readable by the service account, which also runs training jobs.
    credentials = [line.partition("=")[2] for line in inference_unit.splitlines() if line.startswith("LoadCredential=")]
    assert credentials == ["token:/etc/shardstack/inference.token", "tls-cert:/etc/shardstack/inference-tls.crt",
                           "tls-key:/etc/shardstack/inference-tls.key",
                           "signing-key:/etc/shardstack/inference-signing.key"]
    args = build_parser(exec_argv(inference_unit)[1:]).parse_args(exec_argv(inference_unit)[1:])
    assert str(args.token_file) == "%d/token"
    # HTTPS only, with the certificate the cluster CA issued the node (its key root's alone, like the token).
    assert (str(args.tls_cert), str(args.tls_key)) == ("%d/tls-cert", "%d/tls-key")
    # The export is verified against its signed manifest with the cluster key (model.manifest)...
    assert str(args.key_file) == "%d/signing-key" and not args.allow_unsigned


def test_an_unsigned_model_is_served_only_when_the_inventory_says_so() -> None:
    # ...unless the operator serves a directory they trust: then no key reaches the node.
    unit = render("inference_service", "shardstack-inference.service.j2", inventory_hostname="n2",
                  ansible_host="10.0.0.2", inference_service_allow_unsigned=True)
    args = build_parser(exec_argv(unit)[1:]).parse_args(exec_argv(unit)[1:])
    assert args.allow_unsigned
    assert "LoadCredential=signing-key" not in unit and "--key-file" not in unit


def vllm_unit(**variables: object) -> str:
    return render("inference_service", "shardstack-inference.service.j2", inventory_hostname="n3",
                  ansible_host="10.0.0.3", inference_service_engine="vllm", **variables)


def test_a_vllm_node_runs_vllm_from_its_venv_in_the_same_hardened_unit(inference_unit: str) -> None:
    unit = vllm_unit()
    argv = exec_argv(unit)
    assert argv[0] == "/opt/shardstack/vllm-venv/bin/shardstack"
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.engine == "vllm" and args.host == "10.0.0.3" and args.port == 8000 and args.max_concurrency == 8
    # The built-in engine's admission options are not passed to vLLM, which has none of them.
    assert not {"--max-queue", "--stall-seconds", "--device", "--max-tokens", "--max-body-bytes"} & set(argv)
    # The same credentials, readiness, watchdog and sandbox as the built-in engine's unit.
    builtin, vllm = unit_sections(inference_unit)["Service"], unit_sections(unit)["Service"]
    assert str(args.token_file) == "%d/token" and str(args.key_file) == "%d/signing-key"
    assert (str(args.tls_cert), str(args.tls_key)) == ("%d/tls-cert", "%d/tls-key")
    same = {k: v for k, v in builtin.items() if k not in ("ExecStart", "Environment", "Restart")}
    assert vllm["Restart"] == "always"  # it exits 0 when its engine process died
    assert vllm["KillMode"] == "mixed" and "KillMode" not in builtin  # SIGTERM to the server alone: it drains
    assert {k: vllm[k] for k in same} == same
    assert vllm["CacheDirectory"] == "shardstack-inference"  # ProtectSystem=strict: its caches go there
    # Both compile caches there, kept across restarts (torch's default is the unit's private /tmp).
    assert compile_caches(unit) == ("%C/shardstack-inference/vllm", "%C/shardstack-inference/inductor")


@pytest.mark.parametrize(("gpus", "setting", "want"), [(0, 0, 1), (8, 0, 8), (8, 2, 2), (0, 4, 4)])
def test_vllm_shards_over_every_gpu_of_the_node_unless_told(gpus: int, setting: int, want: int) -> None:
    hardware = {"nvidia_gpu_functions": [f"0000:{i:02x}:00.0" for i in range(gpus)]}
    unit = vllm_unit(shardstack_hardware=hardware, inference_service_tensor_parallel=setting,
                     inference_service_kv_cache_gib=3)
    args = build_parser(exec_argv(unit)[1:]).parse_args(exec_argv(unit)[1:])
    assert (args.tensor_parallel, args.kv_cache_gib) == (want, 3)


def test_train_execstart_is_torchrun_with_c10d_and_max_restarts(train_unit: str) -> None:
    from torch.distributed.run import get_args_parser

    svc = unit_sections(train_unit)["Service"]
    assert svc["User"] == "shardstack" and svc["KillMode"] == "mixed"
    argv = exec_argv(train_unit)
    assert argv[0] == "/opt/shardstack/venv/bin/torchrun"
    env = {"SHARDSTACK_NNODES": "2", "SHARDSTACK_NPROC_PER_NODE": "1", "SHARDSTACK_RDZV_ENDPOINT": "10.0.0.1:29400",
           "SHARDSTACK_RDZV_ID": "job", "SHARDSTACK_RDZV_IS_HOST": "true", "SHARDSTACK_MAX_RESTARTS": "3"}
    expanded = [a.replace("%i", "job") for a in argv[1:]]
    for key, value in env.items():
        expanded = [a.replace("${" + key + "}", value) for a in expanded]
    t = get_args_parser().parse_args(expanded)
    assert (t.nnodes, t.nproc_per_node, t.rdzv_backend, t.rdzv_endpoint) == ("2", "1", "c10d", "10.0.0.1:29400")
    assert t.max_restarts == 3 and t.rdzv_conf == "is_host=true"
    assert t.module and t.training_script == "shardstack"
    # What torchrun runs on each rank must parse as `shardstack train run`.
    rest = build_parser(t.training_script_args).parse_args(t.training_script_args)
    assert (rest.command, rest.train_command, rest.config) == ("train", "run", "/etc/shardstack/jobs/job.yaml")


def test_job_env_points_every_node_at_the_head() -> None:
    hostvars = {"n1": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}
    common = {"ansible_play_hosts_all": ["n1", "n2"], "hostvars": hostvars, "training_runtime_job_name": "job",
              **TRAIN_VARS}
    head = dict(line.split("=", 1) for line in render("training_runtime", "job.env.j2", inventory_hostname="n1",
                                                      **common).splitlines() if "=" in line and line[0] != "#")
    other = dict(line.split("=", 1) for line in render("training_runtime", "job.env.j2", inventory_hostname="n2",
                                                       **common).splitlines() if "=" in line and line[0] != "#")
    assert head["SHARDSTACK_RDZV_ENDPOINT"] == other["SHARDSTACK_RDZV_ENDPOINT"] == "10.0.0.1:29400"
    assert (head["SHARDSTACK_RDZV_IS_HOST"], other["SHARDSTACK_RDZV_IS_HOST"]) == ("true", "false")
    assert head["SHARDSTACK_NNODES"] == "2"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["inference", "train"])
def test_units_pass_systemd_analyze_verify(name: str, tmp_path: Path, inference_unit: str, train_unit: str) -> None:
    text = inference_unit if name == "inference" else train_unit
    path = tmp_path / ("shardstack-inference.service" if name == "inference" else "shardstack-train@job.service")
    path.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    # The venv's executables exist only on a node; anything else systemd complains about is a bug.
    problems = [line for line in proc.stderr.splitlines() if line.strip() and "is not executable" not in line]
    assert not problems, proc.stderr


PP = {"inference_service_pipeline_parallel": 2,
      "inference_service_replica_group": "replica_a", "groups": {"replica_a": ["n3", "n4"]},
      "hostvars": {"n3": {"ansible_host": "10.0.0.3"}, "n4": {"ansible_host": "10.0.0.4"}},
      "shardstack_hardware": {"nvidia_gpu_functions": [f"0000:{i:02x}:00.0" for i in range(8)]}}


def ray_unit(host: str, **variables: object) -> str:
    return render("inference_service", "shardstack-ray.service.j2", inventory_hostname=host,
                  ansible_host=PP["hostvars"][host]["ansible_host"], inference_service_engine="vllm",
                  **{**PP, **variables})


def test_pipeline_parallel_runs_vllm_on_the_head_over_the_groups_ray_cluster() -> None:
    """The head's server: `--pipeline-parallel 2` (vllm_argv's --pipeline-parallel-size and the Ray backend) with
    the node's 8 GPUs as each stage's tensor parallel, staging the export where the workers stage theirs, bound to
    the head's Ray unit, and Ray's address in its environment."""
    unit = vllm_unit(**PP)
    args = build_parser(exec_argv(unit)[1:]).parse_args(exec_argv(unit)[1:])
    assert (args.engine, args.pipeline_parallel, args.tensor_parallel) == ("vllm", 2, 8)
    assert str(args.stage_dir) == "/var/lib/shardstack-inference" and str(args.key_file) == "%d/signing-key"
    cp = unit_sections(unit)
    assert {cp["Unit"][k] for k in ("Requires", "After", "PartOf")} >= {"shardstack-ray.service"}
    assert "RAY_ADDRESS=10.0.0.3:6379" in unit and cp["Service"]["ReadWritePaths"] == "%t/shardstack-ray"
    assert cp["Service"]["StateDirectory"] == "shardstack-inference"
    # Without pipeline parallel nothing of it is there.
    plain = vllm_unit()
    assert "shardstack-ray" not in plain and "--pipeline-parallel" not in plain and "RAY_ADDRESS" not in plain


def _ray_argv(unit: str) -> dict[str, str | bool]:
    argv = exec_argv(unit)
    assert argv[:3] == ["/opt/shardstack/vllm-venv/bin/ray", "start", "--block"]
    out: dict[str, str | bool] = {}
    rest = argv[3:]
    while rest:
        flag = rest.pop(0)
        if "=" in flag:
            flag, _, value = flag.partition("=")
            out[flag] = value
        elif rest and not rest[0].startswith("--"):
            out[flag] = rest.pop(0)
        else:
            out[flag] = True
    return out


def test_ray_head_and_worker_units_of_a_replica_group() -> None:
    head, worker = ray_unit("n3"), ray_unit("n4")
    h, w = _ray_argv(head), _ray_argv(worker)
    common = {"--node-manager-port": "6380", "--object-manager-port": "6381", "--min-worker-port": "10002",
              "--max-worker-port": "10101", "--include-dashboard": "false", "--disable-usage-stats": True}
    assert h == {"--head": True, "--port": "6379", "--temp-dir": "%t/shardstack-ray", "--node-ip-address": "10.0.0.3",
                 **common}
    assert w == {"--address": "10.0.0.3:6379", "--node-ip-address": "10.0.0.4", **common}
    # vLLM's workers on it compile into the server's caches.
    assert compile_caches(head) == compile_caches(worker) == compile_caches(vllm_unit(**PP))
    hs, ws = unit_sections(head)["Service"], unit_sections(worker)["Service"]
    assert hs["RuntimeDirectory"] == "shardstack-ray" and "RuntimeDirectory" not in ws
    # A worker node verifies and stages the export where the head's server tells its workers to load it.
    pre = shlex.split(ws["ExecStartPre"])
    stage = build_parser(pre[1:]).parse_args(pre[1:])
    assert (stage.serve_command, str(stage.model), str(stage.key_file), str(stage.into)) == (
        "stage", "/srv/shardstack/exports/current", "%d/signing-key", "/var/lib/shardstack-inference")
    assert "ExecStartPre" not in hs and "LoadCredential" not in hs
    assert "ExecStartPre" not in unit_sections(ray_unit("n4", inference_service_allow_unsigned=True))["Service"]
    # The sandbox of the inference unit, non-root, restarted whenever it exits.
    inference = unit_sections(vllm_unit(**PP))["Service"]
    sandbox = ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateUsers", "ProtectProc",
               "RestrictNamespaces", "SystemCallFilter", "CapabilityBoundingSet", "UMask", "User", "Group")
    assert {k: hs[k] for k in sandbox} == {k: ws[k] for k in sandbox} == {k: inference[k] for k in sandbox}
    assert hs["Restart"] == "always" and "PrivateDevices" not in hs and "ProtectClock" not in hs
    moved = _ray_argv(ray_unit("n4", inference_service_ray_port=7000, inference_service_ray_worker_ports="20000-20015"))
    assert (moved["--address"], moved["--min-worker-port"], moved["--max-worker-port"]) == ("10.0.0.3:7000", "20000",
                                                                                           "20015")


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("host", ["n3", "n4"])
def test_ray_units_pass_systemd_analyze_verify(host: str, tmp_path: Path) -> None:
    path = tmp_path / "shardstack-ray.service"
    path.write_text(ray_unit(host))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    problems = [line for line in proc.stderr.splitlines() if line.strip() and "is not executable" not in line]
    assert not problems, proc.stderr
