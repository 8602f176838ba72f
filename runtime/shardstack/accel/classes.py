"""Which torch build a node needs: the builds shardstack deploys (one per accelerator class), the CUDA each driver
branch runs, and the class for a node's hardware and driver. Pure functions of recorded facts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
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
        return f"{self.name} (CUDA {cuda_text(self.cuda)}, driver branch ≥ {self.min_driver_branch})"


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


def cuda_text(cuda: tuple[int, int]) -> str:
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
        have = f"supports CUDA ≤ {cuda_text(cuda)}" if cuda else "predates CUDA 12"
        raise AcceleratorError(f"driver branch {branch} {have}; torch {TORCH_VERSION} ships {shipped()}",
                               hint=_driver_fix(branch))
    return Choice(accel, f"NVIDIA GPU(s), driver branch {branch} (CUDA ≤ {cuda_text(cuda or (0, 0))}): the newest "
                         f"torch {TORCH_VERSION} build it runs natively is {accel.name}")
