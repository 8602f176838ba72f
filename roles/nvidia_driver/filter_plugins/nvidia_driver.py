"""Filters for the nvidia_driver role: the node's firmware and PCIe state as the preflight reads it."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

# `lspci -vvv` (as root: capabilities are hidden otherwise): one block per function, its first line unindented.
_FUNCTION = re.compile(r"^(?P<address>[0-9a-fA-F:.]+) (?P<klass>[^:]+): (?P<name>.*)$")
_EXPRESS = re.compile(r"Capabilities: \[[0-9a-f]+\] Express \([^)]*\) (?P<kind>[A-Za-z ]+? Port)")
_ACS_CTL = re.compile(r"^\s*ACSCtl:\s*(?P<flags>.*)$")
# The ACS controls that send peer-to-peer traffic up to the root complex (or drop it) instead of across the switch.
_ACS_P2P = ("SrcValid", "ReqRedir", "CmpltRedir")


def secure_boot(mokutil_stdout: str = "", efivar_b64: str = "") -> str:
    """"on", "off" or "unknown": `mokutil --sb-state` if it answered, else the EFI variable SecureBoot as slurp reads
    it (base64 of 4 attribute bytes, then the value: 1 = Secure Boot on)."""
    if "SecureBoot enabled" in mokutil_stdout:
        return "on"
    if "SecureBoot disabled" in mokutil_stdout:
        return "off"
    try:
        raw = base64.b64decode(efivar_b64 or "", validate=True)
    except (binascii.Error, ValueError):
        return "unknown"
    if len(raw) < 5:
        return "unknown"
    return "on" if raw[4] == 1 else "off"


def _acs_on(lspci: str) -> list[dict[str, Any]]:
    """PCIe switch ports (Express Upstream/Downstream Port: not root ports, whose ACS the IOMMU groups need) whose
    ACS control redirects peer-to-peer requests: [{"address", "name", "flags": [...]}]."""
    found = []
    for block in re.split(r"\n(?=\S)", lspci.strip()):
        lines = block.splitlines()
        head = _FUNCTION.match(lines[0]) if lines else None
        if not head or "bridge" not in head["klass"].lower():
            continue
        express = next((m["kind"] for line in lines if (m := _EXPRESS.search(line))), "")
        if express not in ("Upstream Port", "Downstream Port"):
            continue
        ctl = next((m["flags"].split() for line in lines if (m := _ACS_CTL.match(line))), [])
        on = [flag.rstrip("+") for flag in ctl if flag.endswith("+") and flag.rstrip("+") in _ACS_P2P]
        if on:
            found.append({"address": head["address"], "name": head["name"], "flags": on})
    return found


def _iommu_translates(cmdline: str) -> bool:
    """intel_iommu=on without passthrough (iommu=pt, iommu.passthrough=1): every device DMA goes through the IOMMU's
    translation, GPUDirect RDMA's and peer-to-peer's too."""
    args = cmdline.split()
    on = any(a.startswith("intel_iommu=") and "on" in a.split("=", 1)[1].split(",") for a in args)
    passthrough = "iommu=pt" in args or any(a in args for a in ("iommu.passthrough=1", "iommu.passthrough=on",
                                                                  "iommu.passthrough=y"))
    return on and not passthrough


def pcie_check(lspci: str = "", cmdline: str = "", lspci_ok: bool = True) -> dict[str, list[str]]:
    """The PCIe state GPU peer-to-peer and GPUDirect RDMA need: {"problems": [...], "report": [...]}."""
    problems, report = [], []
    if not lspci_ok:
        report.append("ACS not checked: lspci -vvv failed (install pciutils)")
    else:
        acs = _acs_on(lspci)
        if acs:
            ports = ", ".join(f"{p['address']} ({' '.join(f + '+' for f in p['flags'])})" for p in acs)
            problems.append(
                f"ACS is enabled on PCIe switch port(s) {ports}: GPU peer-to-peer and GPUDirect RDMA traffic is sent "
                "up to the root complex instead of across the switch (low bandwidth, NCCL hangs); disable ACS in the "
                "firmware setup, or at every boot with `setpci -s <port> ECAP_ACS+0x6.w=0000`")
        else:
            report.append("ACS off on every PCIe switch port")
    if _iommu_translates(cmdline):
        problems.append(
            "the kernel command line has intel_iommu=on without iommu=pt: the IOMMU translates every GPU and NIC DMA "
            "(GPUDirect RDMA slows down or fails); add iommu=pt (GRUB_CMDLINE_LINUX in /etc/default/grub, "
            "update-grub, reboot)")
    else:
        report.append("IOMMU not translating DMA (no intel_iommu=on, or iommu=pt)")
    return {"problems": problems, "report": report}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"nvidia_driver_secure_boot": secure_boot, "nvidia_driver_pcie_check": pcie_check}
