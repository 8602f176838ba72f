"""Which accelerator a node has and which torch build it needs: the facts, the compatibility table and the decisions.

One place for all of it, used by the wheelhouse (which build a node gets), the training runtime and the inference
service (refuse to fall back to CPU where NVIDIA GPUs are), validate and the GPU self-test (the same checks,
reported). The decisions are pure functions of recorded facts; `probe()` is the only code that looks at the
machine. Whether a node has NVIDIA hardware never depends on torch: PCI vendor 0x10de under /sys/bus/pci/devices
and /dev/nvidia<N>.

    python -m shardstack.accel [--smi] [--dcgm]      this node's facts and verdict as one JSON document
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError

TORCH_VERSION = "2.13.0"
NVIDIA_VENDOR = "0x10de"

# The newest CUDA each driver branch runs natively (nvidia-smi's "CUDA Version"), from NVIDIA's CUDA toolkit
# release notes ("CUDA Toolkit and Corresponding Driver Versions"). A branch between two keys has the lower one's.
DRIVER_BRANCH_CUDA: dict[int, tuple[int, int]] = {
    525: (12, 0), 530: (12, 1), 535: (12, 2), 545: (12, 3), 550: (12, 4), 555: (12, 5), 560: (12, 6),
    565: (12, 7), 570: (12, 8), 575: (12, 9), 580: (13, 0), 590: (13, 1),
}
# CUDA minor-version compatibility: an older driver of the same major runs a newer runtime, except PTX JIT of
# newer PTX ("the provided PTX was compiled with an unsupported toolchain"), which torch.compile's kernels and GPUs
# newer than a wheel's cubins need. Below this floor the runtime does not start at all.
MINOR_COMPAT_FLOOR: dict[int, int] = {12: 525, 13: 580}

PYTORCH_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class AcceleratorClass:
    """One torch build of TORCH_VERSION, and so one wheelhouse."""

    name: str
    cuda: tuple[int, int] | None  # the CUDA runtime torch is built with; None for the CPU build
    torch_version: str  # the exact version string of that build (PEP 440 `===`: no local-label ambiguity)
    index: str | None  # the PyTorch index directory that publishes it; None: PyPI itself

    @property
    def min_driver_branch(self) -> int | None:
        """The oldest driver branch that runs this build natively."""
        return None if self.cuda is None else native_branch(self.cuda)

    @property
    def floor_driver_branch(self) -> int | None:
        """The oldest driver branch that runs it at all (minor-version compatibility)."""
        return None if self.cuda is None else MINOR_COMPAT_FLOOR[self.cuda[0]]

    def describe(self) -> str:
        if self.cuda is None:
            return f"{self.name} (CPU build)"
        return f"{self.name} (CUDA {_v(self.cuda)}, driver branch ≥ {self.min_driver_branch})"


# The builds of torch 2.13.0 for Linux x86_64 / CPython 3.11 that shardstack deploys, oldest CUDA first. PyPI's
# own torch 2.13.0 wheel is the CUDA 13.0 build (it requires cuda-toolkit 13.0.3 and nvidia-*-cu13); the others are
# on PyTorch's index. 12.6 is the oldest CUDA torch 2.13.0 ships; it has no Blackwell (sm_100) kernels, 12.9 does.
CLASSES: tuple[AcceleratorClass, ...] = (
    AcceleratorClass("cpu", None, f"{TORCH_VERSION}+cpu", "cpu"),
    AcceleratorClass("cu126", (12, 6), f"{TORCH_VERSION}+cu126", "cu126"),
    AcceleratorClass("cu129", (12, 9), f"{TORCH_VERSION}+cu129", "cu129"),
    AcceleratorClass("cu130", (13, 0), TORCH_VERSION, None),
)
BY_NAME: dict[str, AcceleratorClass] = {c.name: c for c in CLASSES}


class AcceleratorError(ShardstackError):
    """This node cannot run (or should not get) the requested accelerator; the message names cause and fix."""


def _v(cuda: tuple[int, int]) -> str:
    return f"{cuda[0]}.{cuda[1]}"


def parse_branch(value: str | int | None) -> int | None:
    """"570", 570, "570.86.15" → 570; empty → None."""
    if value is None or str(value).strip() == "":
        return None
    m = re.match(r"\s*(\d+)", str(value))
    if not m:
        raise AcceleratorError(f"driver branch {value!r} is not a number", hint="e.g. nvidia_driver_branch: \"580\"")
    return int(m.group(1))


def native_branch(cuda: tuple[int, int]) -> int | None:
    """The oldest driver branch that runs a CUDA version natively; None when the table has none yet."""
    fits = [b for b, c in DRIVER_BRANCH_CUDA.items() if c >= cuda]
    return min(fits) if fits else None


def driver_cuda(branch: int) -> tuple[int, int] | None:
    """The newest CUDA a driver branch runs natively; None below the table (CUDA 11 and older)."""
    known = [b for b in DRIVER_BRANCH_CUDA if b <= branch]
    return DRIVER_BRANCH_CUDA[max(known)] if known else None


def _cuda_classes() -> list[AcceleratorClass]:
    return [c for c in CLASSES if c.cuda is not None]


def shipped() -> str:
    return ", ".join(c.describe() for c in _cuda_classes())


def newest_native(branch: int) -> AcceleratorClass | None:
    """The newest CUDA build a driver branch runs natively."""
    fits = [c for c in _cuda_classes() if (c.min_driver_branch or 0) <= branch]
    return fits[-1] if fits else None


def _driver_fix(branch: int) -> str:
    oldest = _cuda_classes()[0]
    return (f"install driver branch ≥ {oldest.min_driver_branch} (nvidia_driver_branch, from NVIDIA's repository: "
            f"nvidia_driver_source: cuda_repo), or pin a build this driver runs by minor-version compatibility "
            f"(shardstack_accelerator: {oldest.name}, branch ≥ {oldest.floor_driver_branch}; no PTX JIT of newer "
            f"code)")


@dataclass(frozen=True)
class Choice:
    accel: AcceleratorClass
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"accelerator": self.accel.name, "reason": self.reason}


def has_nvidia(hardware: Mapping[str, Any]) -> bool:
    """The preflight's `shardstack_hardware` (or NodeFacts.hardware()): any NVIDIA PCI function or /dev/nvidia<N>."""
    return bool(hardware.get("nvidia_pci_functions") or hardware.get("nvidia_device_nodes"))


def accelerator_class(hardware: Mapping[str, Any], driver_branch: str | int | None,
                      override: str | None = None) -> Choice:
    """The torch build (wheelhouse) a node gets, and why.

    `hardware` is what the preflight probed (nvidia_pci_functions, nvidia_device_nodes), `driver_branch` the
    branch the node runs or is pinned to (nvidia_driver_branch), `override` the operator's `shardstack_accelerator`
    (a class name, or auto/None). A node without NVIDIA hardware gets the CPU build; a GPU node the newest CUDA
    build its driver branch runs natively.
    """
    gpus = has_nvidia(hardware)
    branch = parse_branch(driver_branch)
    if override and override != "auto":
        if override not in BY_NAME:
            raise AcceleratorError(f"unknown accelerator class {override!r}",
                                   hint=f"shardstack_accelerator is auto or one of {', '.join(BY_NAME)}")
        accel = BY_NAME[override]
        if accel.cuda is None:
            return Choice(accel, "set by shardstack_accelerator" + (
                " on a node with NVIDIA GPUs: jobs there need engine.device: cpu" if gpus else ""))
        if gpus and branch is not None and branch < (accel.floor_driver_branch or 0):
            raise AcceleratorError(
                f"shardstack_accelerator {accel.name} needs driver branch ≥ {accel.floor_driver_branch} even by "
                f"minor-version compatibility; this node's branch is {branch}",
                hint=_driver_fix(branch))
        native = branch is None or branch >= (accel.min_driver_branch or 0)
        return Choice(accel, f"set by shardstack_accelerator ({accel.describe()})" + (
            "" if native else f"; driver branch {branch} runs it by CUDA minor-version compatibility only"))
    if not gpus:
        return Choice(BY_NAME["cpu"], "no NVIDIA hardware (no PCI vendor 0x10de, no /dev/nvidia<N>)")
    if branch is None:
        raise AcceleratorError("this node has NVIDIA GPUs but no driver branch is known",
                               hint="set nvidia_driver_branch (e.g. \"580\") in the inventory")
    accel = newest_native(branch)
    cuda = driver_cuda(branch)
    if accel is None:
        have = f"supports CUDA ≤ {_v(cuda)}" if cuda else "predates CUDA 12"
        raise AcceleratorError(f"driver branch {branch} {have}; torch {TORCH_VERSION} ships {shipped()}",
                               hint=_driver_fix(branch))
    return Choice(accel, f"NVIDIA GPU(s), driver branch {branch} (CUDA ≤ {_v(cuda or (0, 0))}): the newest "
                         f"torch {TORCH_VERSION} build it runs natively is {accel.name}")


# --- the node's facts ---------------------------------------------------------------------------------------------


@dataclass
class NodeFacts:
    """What one node shows; `probe()` records it, the decisions below only read it (tests pass recorded ones)."""

    gpus: list[str] = field(default_factory=list)  # PCI addresses: vendor 0x10de, class 0x03 (display/3D)
    nvidia_functions: int = 0  # every vendor 0x10de function (GPUs, NVSwitches, audio)
    device_nodes: list[str] = field(default_factory=list)  # /dev/nvidia<N>
    driver_version: str | None = None  # /sys/module/nvidia/version: the loaded kernel module
    nvidia_smi: str | None = None  # its path; None when not installed
    smi_rc: int | None = None  # exit code of `nvidia-smi --query-gpu`; None when not run
    smi_output: list[str] = field(default_factory=list)
    torch_version: str | None = None  # None: torch not importable
    torch_cuda: str | None = None  # torch.version.cuda; None for a CPU build
    cuda_available: bool | None = None  # None: not asked (no NVIDIA hardware, or a CPU build)
    cuda_error: str | None = None  # what initialising CUDA raised
    cuda_devices: list[str] = field(default_factory=list)
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES
    dcgm_rc: int | None = None  # `dcgmi diag -r 1`; None when not run (no GPU, or DCGM not installed)
    dcgm_output: list[str] = field(default_factory=list)

    @property
    def has_nvidia(self) -> bool:
        return has_nvidia(self.hardware())

    def hardware(self) -> dict[str, list[str]]:
        """In the shape of the preflight's `shardstack_hardware`."""
        return {"nvidia_pci_functions": self.gpus, "nvidia_device_nodes": self.device_nodes}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeFacts:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _run(argv: list[str], timeout: float) -> tuple[int, list[str]]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, [f"{argv[0]} did not answer within {timeout:.0f} s"]
    except OSError as exc:
        return 127, [str(exc)]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, lines[-40:]


def probe(*, root: Path = Path("/"), torch_facts: bool = True, smi: bool = False, dcgm: bool = False) -> NodeFacts:
    """Look at this machine: PCI functions and device nodes, the loaded driver, nvidia-smi, and torch's view.

    `root` lets a test point it at a recorded /sys and /dev tree. torch is asked about CUDA only where NVIDIA
    hardware is, so a CPU node never initialises CUDA. `smi` runs nvidia-smi, `dcgm` runs `dcgmi diag -r 1`
    (about 30 s) where NVIDIA hardware and DCGM are.
    """
    facts = NodeFacts(visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    pci = root / "sys/bus/pci/devices"
    for dev in sorted(pci.iterdir()) if pci.is_dir() else []:
        if _read(dev / "vendor") != NVIDIA_VENDOR:
            continue
        facts.nvidia_functions += 1
        if (_read(dev / "class") or "").startswith("0x03"):
            facts.gpus.append(dev.name)
    devdir = root / "dev"
    facts.device_nodes = sorted(str(p) for p in devdir.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))
    facts.driver_version = _read(root / "sys/module/nvidia/version")
    facts.nvidia_smi = shutil.which("nvidia-smi")
    if smi and facts.nvidia_smi:
        facts.smi_rc, facts.smi_output = _run(
            [facts.nvidia_smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 60)
    if dcgm and facts.has_nvidia and (dcgmi := shutil.which("dcgmi")):
        facts.dcgm_rc, facts.dcgm_output = _run([dcgmi, "diag", "-r", "1"], 300)
    if torch_facts:
        _probe_torch(facts)
    return facts


def _probe_torch(facts: NodeFacts) -> None:
    try:
        import torch
    except ImportError:
        return
    facts.torch_version = torch.__version__
    facts.torch_cuda = torch.version.cuda
    if not (facts.has_nvidia and facts.torch_cuda):
        return
    try:
        torch.cuda.init()  # raises the driver's reason (no driver, driver too old) where is_available() only says no
    except Exception as exc:
        facts.cuda_error = " ".join(str(exc).split())[:500]
    facts.cuda_available = torch.cuda.is_available()
    if facts.cuda_available:
        facts.cuda_devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


# --- decisions on the facts ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    check: str  # driver | torch build | cuda | dcgm
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


def _gpu_count(facts: NodeFacts) -> str:
    n = len(facts.gpus) or len(facts.device_nodes)
    return f"{n} NVIDIA GPU(s)"


def gpu_problems(facts: NodeFacts) -> list[Problem]:
    """Everything that keeps a node with NVIDIA hardware from running torch on CUDA (empty: nothing, or no GPU)."""
    if not facts.has_nvidia:
        return []
    out: list[Problem] = []
    gpus = _gpu_count(facts)
    if facts.driver_version is None:
        out.append(Problem("driver", f"the NVIDIA kernel module is not loaded (no /sys/module/nvidia/version) on a "
                                     f"node with {gpus}: install it (site.yml --tags gpu); a new module needs a "
                                     f"reboot (nvidia_driver_reboot_allowed)"))
    if facts.nvidia_smi is None:
        out.append(Problem("driver", f"nvidia-smi is not installed on a node with {gpus}: the driver's userspace "
                                     f"is missing (nvidia_driver role)"))
    elif facts.smi_rc not in (None, 0):
        why = facts.smi_output[-1] if facts.smi_output else "no output"
        out.append(Problem("driver", f"nvidia-smi failed (exit {facts.smi_rc}): {why}"))
    if facts.torch_version is not None and facts.torch_cuda is None:
        out.append(Problem("torch build", f"torch {facts.torch_version} is a CPU build (torch.version.cuda is None) "
                                          f"on a node with {gpus}: install this node's CUDA wheelhouse "
                                          f"(shardstack wheelhouse --accelerator auto; shardstack_accelerator)"))
    if facts.torch_cuda and facts.cuda_available is False:
        out.append(_cuda_problem(facts))
    if facts.dcgm_rc not in (None, 0):
        tail = "; ".join(line.strip() for line in facts.dcgm_output if re.search(r"fail|error", line, re.I))[:300]
        out.append(Problem("dcgm", f"`dcgmi diag -r 1` failed (exit {facts.dcgm_rc}): {tail or 'no detail'}"))
    return out


def _cuda_problem(facts: NodeFacts) -> Problem:
    assert facts.torch_cuda is not None
    major, minor = (int(x) for x in facts.torch_cuda.split(".")[:2])
    want = (major, minor)
    branch = parse_branch(facts.driver_version) if facts.driver_version else None
    have = driver_cuda(branch) if branch else None
    if facts.visible_devices is not None and facts.visible_devices.strip() in ("", "-1"):
        return Problem("cuda", f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides every GPU from torch")
    if branch is not None and (have is None or have < want):
        runs = newest_native(branch)
        need = native_branch(want)
        fix = (f"install driver branch ≥ {need} (nvidia_driver_branch)" if need else "install a newer driver") + (
            f", or the {runs.name} wheelhouse (shardstack_accelerator: {runs.name})" if runs else "")
        return Problem("cuda", f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda}, newer than driver "
                               f"{facts.driver_version} runs (CUDA ≤ {_v(have) if have else '11'}): {fix}")
    why = facts.cuda_error or "torch.cuda.is_available() is False"
    return Problem("cuda", f"torch {facts.torch_version} (CUDA {facts.torch_cuda}) cannot initialise CUDA: {why}")


@dataclass(frozen=True)
class DeviceChoice:
    type: str  # cuda | cpu
    backend: str  # nccl | gloo
    why: str  # for the first log line


def decide_device(facts: NodeFacts, requested: str, *, setting: str = "engine.device") -> DeviceChoice:
    """Where a process runs, from the node's facts and what was asked (auto | cpu | cuda).

    cpu is always granted. A node with NVIDIA hardware runs on CUDA, and if it cannot (driver, torch build, CUDA
    runtime), auto and cuda both refuse with the causes: silently training or serving on CPU there is the failure
    this exists to prevent. auto without NVIDIA hardware is CPU + gloo; cuda there is refused.
    """
    if requested == "cpu":
        return DeviceChoice("cpu", "gloo", f"{setting} is 'cpu'")
    if requested not in ("auto", "cuda"):
        raise AcceleratorError(f"{setting} {requested!r} is not auto, cpu or cuda")
    if not facts.has_nvidia:
        if requested == "cuda":
            raise AcceleratorError(f"{setting} is 'cuda' but this node has no NVIDIA GPU (no PCI vendor 0x10de, no "
                                   f"/dev/nvidia<N>)", hint=f"use {setting} auto (CPU here) or run on a GPU node")
        return DeviceChoice("cpu", "gloo", "no NVIDIA GPU on this node: no PCI vendor 0x10de, no /dev/nvidia<N>")
    if facts.cuda_available and facts.cuda_devices:
        return DeviceChoice("cuda", "nccl", facts.cuda_devices[0])
    problems = [p for p in gpu_problems(facts) if p.check != "dcgm"] or [
        Problem("cuda", "torch sees no CUDA device (torch.cuda.is_available() is False)")]
    causes = "\n".join(f"  - {p}" for p in problems)
    raise AcceleratorError(f"this node has {_gpu_count(facts)} but torch cannot use CUDA, and it will not fall back "
                           f"to CPU:\n{causes}", hint=f"fix the above, or set {setting} cpu to run on CPU on purpose")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardstack.accel", description=__doc__.splitlines()[0])
    p.add_argument("--smi", action="store_true", help="run nvidia-smi where it is installed")
    p.add_argument("--dcgm", action="store_true", help="run `dcgmi diag -r 1` on NVIDIA nodes where DCGM is")
    p.add_argument("--driver-branch", default=None, help="branch for the accelerator class (default: the loaded one)")
    args = p.parse_args(argv)
    facts = probe(smi=args.smi, dcgm=args.dcgm)
    out: dict[str, Any] = {"facts": facts.to_dict(), "has_nvidia": facts.has_nvidia,
                           "problems": [asdict(x) for x in gpu_problems(facts)]}
    try:
        out |= accelerator_class(facts.hardware(), args.driver_branch or facts.driver_version).to_dict()
    except AcceleratorError as exc:
        out |= {"accelerator": None, "reason": str(exc)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
