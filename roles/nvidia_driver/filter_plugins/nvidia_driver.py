"""Filters for the nvidia_driver role: the node's firmware and PCIe state as the preflight reads it."""

from __future__ import annotations

import base64
import binascii
from typing import Any


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


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"nvidia_driver_secure_boot": secure_boot}
