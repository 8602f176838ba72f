"""Where a process runs, decided on a node's facts: what keeps torch from using its NVIDIA GPUs, and CUDA or CPU for
what was asked (never a silent fall back to CPU where GPUs are)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardstack.accel.classes import (
    AcceleratorError,
    cuda_text,
    driver_cuda,
    native_branch,
    newest_native,
    parse_branch,
)
from shardstack.accel.facts import NodeFacts


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
                               f"{facts.driver_version} runs (CUDA ≤ {cuda_text(have) if have else '11'}): {fix}")
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
