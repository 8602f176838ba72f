"""MFU's denominator: the dense bf16 peak per GPU, from the device name torch reports (as nvidia-smi prints it)."""

from __future__ import annotations

import pytest
from shardstack.train.metrics import gpu_peak_tflops


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA H800", 989.0),
    ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A800 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 70.0),
])
def test_known_gpus(name: str, peak: float) -> None:
    assert gpu_peak_tflops(name) == peak


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB", "NVIDIA A40", "NVIDIA H20"])
def test_unknown_gpus_have_no_figure(name: str) -> None:
    """No guess from a near name (an A40 is not an A100, an H20 not an H200): the job must set metrics.peak_tflops."""
    assert gpu_peak_tflops(name) is None
