"""Which accelerator a node has and which torch build it needs: the facts, the compatibility table and the decisions.

One package for all of it, used by the wheelhouse (which build a node gets), the training runtime and the inference
service (refuse to fall back to CPU where NVIDIA GPUs are), validate and the GPU self-test (the same checks,
reported). The decisions are pure functions of recorded facts; `probe()` is the only code that looks at the
machine. Whether a node has NVIDIA hardware never depends on torch: PCI vendor 0x10de under /sys/bus/pci/devices
and /dev/nvidia<N>.

    classes.py   the torch builds, the driver branches' CUDA, the class for a node (pure)
    facts.py     NodeFacts and probe(), the only code that looks at the machine
    device.py    the problems that keep torch off the GPUs, and CUDA or CPU for a process (pure)
    python -m shardstack.accel [--smi] [--dcgm]      this node's facts and verdict as one JSON document
"""

from shardstack.accel.classes import (
    BY_NAME,
    CLASSES,
    PYTORCH_INDEX,
    TORCH_VERSION,
    AcceleratorClass,
    AcceleratorError,
    Choice,
    accelerator_class,
    driver_cuda,
    has_nvidia,
    parse_branch,
)
from shardstack.accel.device import DeviceChoice, Problem, decide_device, gpu_problems
from shardstack.accel.facts import NodeFacts, probe

__all__ = [
    "BY_NAME", "CLASSES", "PYTORCH_INDEX", "TORCH_VERSION", "AcceleratorClass", "AcceleratorError", "Choice",
    "DeviceChoice", "NodeFacts", "Problem", "accelerator_class", "decide_device", "driver_cuda", "gpu_problems",
    "has_nvidia", "parse_branch", "probe",
]
