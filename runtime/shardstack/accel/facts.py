"""What one node shows: NVIDIA PCI functions, /dev/nvidia<N>, the loaded driver, nvidia-smi, DCGM and torch's
build. `probe()` is the only code in shardstack.accel that looks at the machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardstack.accel.classes import NVIDIA_VENDOR, has_nvidia


@dataclass
class NodeFacts:
    """What one node shows; `probe()` records it, the decisions (classes.py, device.py) only read it (tests pass
    recorded ones)."""

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
