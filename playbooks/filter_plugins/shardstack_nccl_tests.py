"""validate.yml's NCCL sweep: nccl-tests' `*_perf` output as data."""

from __future__ import annotations

import re
from typing import Any

# A result row: size count type redop root, then out-of-place time algbw busbw #wrong, then in-place the same.
_ROW = re.compile(r"^\s*(?P<size>\d+)\s+\d+\s+\S+\s+\S+\s+-?\d+\s+(?P<time>[\d.]+)\s+(?P<algbw>[\d.]+)\s+"
                  r"(?P<busbw>[\d.]+)\s+(?P<wrong>\S+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(?P<avg>[\d.]+)")


def nccl_tests_result(stdout: str) -> dict[str, Any]:
    """{"rows": [{"bytes", "busbw"}], "peak_busbw": out-of-place busbw (GB/s) at the largest size, "avg_busbw",
    "wrong": rows with wrong values (N/A counts as none)}. Empty rows: the run printed no result."""
    rows, wrong, avg = [], 0, None
    for line in stdout.splitlines():
        if m := _ROW.match(line):
            rows.append({"bytes": int(m["size"]), "busbw": float(m["busbw"])})
            wrong += 1 if m["wrong"].isdigit() and int(m["wrong"]) > 0 else 0
        elif m := _AVG.match(line):
            avg = float(m["avg"])
    peak = max(rows, key=lambda r: r["bytes"])["busbw"] if rows else 0.0
    return {"rows": rows, "peak_busbw": peak, "avg_busbw": avg if avg is not None else 0.0, "wrong": wrong}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_nccl_tests": nccl_tests_result}
