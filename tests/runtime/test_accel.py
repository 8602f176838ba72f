"""The accelerator decisions (shardstack.accel) on recorded facts: which build a node gets, and when the training
runtime and the inference service refuse to run instead of falling back to CPU. The facts are what real nodes show
(sysfs trees, driver versions, torch's own error texts); nothing here stands in for torch or the kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardstack import accel
from shardstack.accel import AcceleratorError, NodeFacts, accelerator_class, decide_device, gpu_problems, probe

H100 = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]
HW_GPU = {"nvidia_pci_functions": [f"/sys/bus/pci/devices/{a}/vendor" for a in H100], "nvidia_device_nodes": []}
HW_NONE: dict[str, list[str]] = {"nvidia_pci_functions": [], "nvidia_device_nodes": []}
# torch's own messages when CUDA cannot start (torch/cuda/__init__.py, c10/cuda)
NO_DRIVER = ("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a driver "
             "from http://www.nvidia.com/Download/index.aspx")
TOO_OLD = ("The NVIDIA driver on your system is too old (found version 12080). Please update your GPU driver by "
           "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")


def gpu_node(**over) -> NodeFacts:
    """A healthy 4 × H100 node with the cu130 build (driver 580.65.06), then whatever `over` breaks."""
    base = dict(gpus=H100, nvidia_functions=6, device_nodes=[f"/dev/nvidia{i}" for i in range(4)],
                driver_version="580.65.06", nvidia_smi="/usr/bin/nvidia-smi", smi_rc=0,
                smi_output=["NVIDIA H100 80GB HBM3, 580.65.06, 81559 MiB"] * 4, torch_version="2.13.0",
                torch_cuda="13.0", cuda_available=True, cuda_devices=["NVIDIA H100 80GB HBM3"] * 4)
    return NodeFacts(**{**base, **over})


# --- the class a node gets --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("branch", "want"), [("560", "cu126"), ("570", "cu126"), ("575", "cu129"),
                                              ("580", "cu130"), ("590", "cu130"), ("580.65.06", "cu130")])
def test_a_gpu_node_gets_the_newest_build_its_driver_branch_runs(branch: str, want: str) -> None:
    choice = accelerator_class(HW_GPU, branch)
    assert choice.accel.name == want
    assert f"driver branch {branch.split('.')[0]}" in choice.reason


def test_a_node_without_nvidia_hardware_gets_the_cpu_build_whatever_the_branch() -> None:
    for branch in (None, "", "535", "580"):
        choice = accelerator_class(HW_NONE, branch)
        assert choice.accel.name == "cpu" and "no NVIDIA hardware" in choice.reason


def test_a_device_node_alone_counts_as_nvidia_hardware() -> None:
    # containers often see /dev/nvidia0 but a sysfs without the host's PCI tree
    assert accelerator_class({"nvidia_pci_functions": [], "nvidia_device_nodes": ["/dev/nvidia0"]}, "580").accel.name \
        == "cu130"


@pytest.mark.parametrize("branch", ["535", "550", "470"])
def test_a_driver_branch_older_than_every_cuda_build_fails_naming_the_fix(branch: str) -> None:
    with pytest.raises(AcceleratorError) as err:
        accelerator_class(HW_GPU, branch)
    text = str(err.value)
    assert text.startswith(f"driver branch {branch} ")
    assert ("supports CUDA ≤ 12.2" if branch == "535" else "") in text
    assert "torch 2.13.0 ships cu126 (CUDA 12.6, driver branch ≥ 560), cu129 (CUDA 12.9, driver branch ≥ 575)" in text
    assert "install driver branch ≥ 560 (nvidia_driver_branch" in text and "shardstack_accelerator: cu126" in text


def test_a_gpu_node_without_a_known_branch_is_an_error() -> None:
    with pytest.raises(AcceleratorError, match="no driver branch is known"):
        accelerator_class(HW_GPU, None)


def test_overrides() -> None:
    assert accelerator_class(HW_GPU, "580", "auto").accel.name == "cu130"
    forced = accelerator_class(HW_GPU, "535", "cu126")  # minor-version compatibility: allowed, and said
    assert forced.accel.name == "cu126" and "minor-version compatibility only" in forced.reason
    cpu = accelerator_class(HW_GPU, "580", "cpu")
    assert cpu.accel.name == "cpu" and "engine.device: cpu" in cpu.reason
    with pytest.raises(AcceleratorError, match="needs driver branch ≥ 580 even by minor-version compatibility"):
        accelerator_class(HW_GPU, "570", "cu130")  # CUDA 13 on a CUDA 12 driver does not start at all
    with pytest.raises(AcceleratorError, match="unknown accelerator class 'cu128'"):
        accelerator_class(HW_GPU, "580", "cu128")


def test_the_compatibility_table_is_consistent() -> None:
    # every CUDA build needs a branch the table knows, the CPU build none; oldest CUDA first
    cudas = [c.cuda for c in accel.CLASSES if c.cuda]
    assert cudas == sorted(cudas)
    assert [c.min_driver_branch for c in accel.CLASSES] == [None, 560, 575, 580]
    assert all(c.torch_version.startswith(accel.TORCH_VERSION) for c in accel.CLASSES)
    assert accel.driver_cuda(535) == (12, 2) and accel.driver_cuda(572) == (12, 8) and accel.driver_cuda(470) is None


# --- fail loud ----------------------------------------------------------------------------------------------------


def test_a_healthy_gpu_node_runs_on_cuda_and_nccl() -> None:
    assert decide_device(gpu_node(), "auto") == accel.DeviceChoice("cuda", "nccl", "NVIDIA H100 80GB HBM3")
    assert decide_device(gpu_node(), "cuda").type == "cuda"
    assert gpu_problems(gpu_node()) == []


def test_a_cpu_node_stays_on_cpu_and_gloo_and_says_why() -> None:
    cpu = NodeFacts(torch_version="2.13.0+cpu")
    choice = decide_device(cpu, "auto")
    assert (choice.type, choice.backend) == ("cpu", "gloo") and "no NVIDIA GPU on this node" in choice.why
    assert gpu_problems(cpu) == []
    with pytest.raises(AcceleratorError, match=r"engine\.device is 'cuda' but this node has no NVIDIA GPU") as err:
        decide_device(cpu, "cuda")
    assert err.value.exit_code == 2
    with pytest.raises(AcceleratorError, match="--device is 'cuda'"):
        decide_device(cpu, "cuda", setting="--device")


BROKEN = {
    "cpu build of torch": (dict(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=None, cuda_devices=[]),
                           "torch build: torch 2.13.0+cpu is a CPU build (torch.version.cuda is None) on a node with "
                           "4 NVIDIA GPU(s)"),
    "driver not loaded": (dict(driver_version=None, device_nodes=[], smi_rc=9, cuda_available=False, cuda_devices=[],
                               smi_output=["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                           "driver. Make sure that the latest NVIDIA driver is installed and running."],
                               cuda_error=NO_DRIVER),
                          "driver: the NVIDIA kernel module is not loaded"),
    "nvidia-smi missing": (dict(nvidia_smi=None, smi_rc=None, smi_output=[], driver_version=None, cuda_available=False,
                                cuda_devices=[], cuda_error=NO_DRIVER),
                           "driver: nvidia-smi is not installed on a node with 4 NVIDIA GPU(s)"),
    "CUDA newer than the driver": (dict(driver_version="570.86.15", cuda_available=False, cuda_devices=[],
                                        cuda_error=TOO_OLD),
                                   "cuda: torch 2.13.0 is built for CUDA 13.0, newer than driver 570.86.15 runs "
                                   "(CUDA ≤ 12.8): install driver branch ≥ 580 (nvidia_driver_branch), or the cu126 "
                                   "wheelhouse (shardstack_accelerator: cu126)"),
    "GPUs hidden": (dict(visible_devices="", cuda_available=False, cuda_devices=[]),
                    "cuda: CUDA_VISIBLE_DEVICES='' hides every GPU from torch"),
    "CUDA init error": (dict(cuda_available=False, cuda_devices=[],
                             cuda_error="CUDA error: system not yet initialized"),
                        "cuda: torch 2.13.0 (CUDA 13.0) cannot initialise CUDA: CUDA error: system not yet "
                        "initialized"),
}


@pytest.mark.parametrize("case", BROKEN)
@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_a_broken_gpu_node_refuses_to_run_naming_the_cause(case: str, requested: str) -> None:
    broken, expected = BROKEN[case]
    facts = gpu_node(**broken)
    assert expected in [str(p)[: len(expected)] for p in gpu_problems(facts)]
    with pytest.raises(AcceleratorError) as err:
        decide_device(facts, requested)
    assert str(err.value).startswith("this node has 4 NVIDIA GPU(s) but torch cannot use CUDA, and it will not fall "
                                     "back to CPU:")
    assert f"  - {expected}" in str(err.value) and "set engine.device cpu to run on CPU on purpose" in str(err.value)
    assert err.value.exit_code == 2
    assert decide_device(facts, "cpu").type == "cpu"  # asked for on purpose: granted


def test_a_gpu_node_whose_cuda_works_runs_even_with_a_finding_validate_reports() -> None:
    facts = gpu_node(nvidia_smi=None, smi_rc=None)
    assert decide_device(facts, "auto").type == "cuda"
    assert [p.check for p in gpu_problems(facts)] == ["driver"]


# --- the probe on recorded sysfs trees ------------------------------------------------------------------------------


def _tree(root: Path, functions: dict[str, tuple[str, str]], devnodes: list[str], driver: str | None) -> Path:
    for addr, (vendor, cls) in functions.items():
        d = root / "sys/bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for name in devnodes:
        (root / "dev" / name).write_text("")
    if driver:
        (root / "sys/module/nvidia").mkdir(parents=True)
        (root / "sys/module/nvidia/version").write_text(driver + "\n")
    return root


def test_probe_counts_gpus_not_nvswitches_and_ignores_nvidiactl(tmp_path: Path) -> None:
    # an HGX board: GPUs are 3D controllers (0x0302), NVSwitches bridges (0x0680); plus an Intel NIC
    functions = {a: ("0x10de", "0x030200") for a in H100} | {
        "0000:05:00.0": ("0x10de", "0x068000"), "0000:06:00.0": ("0x10de", "0x068000"),
        "0000:01:00.0": ("0x8086", "0x020000")}
    root = _tree(tmp_path, functions, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"], "580.65.06")
    facts = probe(root=root, torch_facts=False)
    assert facts.gpus == sorted(H100) and facts.nvidia_functions == 6
    assert facts.device_nodes == [str(root / "dev/nvidia0"), str(root / "dev/nvidia1")]
    assert facts.driver_version == "580.65.06" and facts.has_nvidia
    assert accelerator_class(facts.hardware(), facts.driver_version).accel.name == "cu130"


def test_probe_of_a_cpu_node_never_asks_torch_about_cuda(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"0000:00:02.0": ("0x8086", "0x030000")}, ["nvidiactl"], None)
    facts = probe(root=root)
    assert not facts.has_nvidia and facts.gpus == [] and facts.device_nodes == []
    assert facts.torch_version == torch.__version__ and facts.torch_cuda == torch.version.cuda
    assert facts.cuda_available is None  # not asked
    assert decide_device(facts, "auto").type == "cpu"


def test_this_machine_reports_itself_as_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "shardstack.accel", "--smi"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    facts = NodeFacts.from_dict(out["facts"])
    assert out["has_nvidia"] == facts.has_nvidia
    if not facts.has_nvidia:  # the CI machine and this one
        assert (out["accelerator"], out["problems"]) == ("cpu", [])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(probe(torch_facts=False).has_nvidia, reason="checks the refusal on a machine without NVIDIA GPUs")
def test_asking_for_cuda_without_a_gpu_exits_2_with_the_cause(tmp_path: Path) -> None:
    from shardstack.serve.demo import write_random_model

    job = tmp_path / "job.yaml"
    job.write_text("model: {size: tiny}\nengine: {device: cuda}\n")
    train = _cli("train", "run", "--config", str(job))
    serve = _cli("serve", "--model", str(write_random_model(tmp_path / "m", "tiny")), "--device", "cuda:1",
                 "--port", "1", "--allow-unsigned")
    for proc, setting in ((train, "engine.device"), (serve, "--device")):
        assert proc.returncode == 2, proc.stderr
        assert f"shardstack: error: {setting} is 'cuda' but this node has no NVIDIA GPU" in proc.stderr
        assert "Traceback" not in proc.stderr
