"""validate.yml's NCCL sweep: the command it runs (every GPU of the node, 1M to 8G) and its verdict on recorded
all_reduce_perf output (nccl-tests 2.13, 8x H100 SXM, NVSwitch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"

GPU = "/sys/bus/pci/devices/0000:{:02x}:00.0/vendor"

SWEEP = """\
# nThread 1 nGpus 8 minBytes 1048576 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1    33.71   31.10   54.43      0    33.02   31.76   55.57      0
     2097152        524288     float     sum      -1    39.58   52.99   92.73      0    38.93   53.87   94.27      0
     4194304       1048576     float     sum      -1    48.33   86.78  151.87      0    47.90   87.56  153.23      0
  4294967296    1073741824     float     sum      -1    17981  238.86  418.01      0    17966  239.06  418.35      0
  8589934592    2147483648     float     sum      -1    35560  241.56  422.73      0    35529  241.77  423.10      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 228.172
#
"""


def _play() -> dict[str, Any]:
    plays = yaml.safe_load((ROLES.parent / "playbooks/validate.yml").read_text())
    return next(p for p in plays if p["name"].startswith("Validate - NCCL bandwidth sweep"))


def _task(play: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next(t for t in play["tasks"] if t["name"].startswith(prefix))


def _eval(role_eval: Any, hardware: Any, facts: dict, stdout: str, rc: int = 0, exists: tuple = (True, True),
          **extra: Any) -> Any:
    bins = {"results": [{"stat": {"exists": e, **({"path": f"/opt/nccl-tests/{d}/all_reduce_perf"} if e else {})}}
                        for d, e in zip(("build-mpi", "build"), exists, strict=True)]}
    gpus = hardware(pci=tuple(GPU.format(0x18 + i) for i in range(8)))
    return role_eval("nccl", facts, **_play()["vars"], shardstack_hardware=gpus, __nccl_tests_bins=bins,
                     validate_nccl_sweep={"rc": rc, "stdout": stdout, "stderr_lines": ["NCCL WARN oops"]}, **extra)


def test_the_sweep_uses_every_gpu_from_1m_to_8g(role_eval: Any, hardware: Any, debian_container: dict) -> None:
    r = _eval(role_eval, hardware, debian_container, SWEEP)
    assert r["__sweep"] == ["/opt/nccl-tests/build-mpi/all_reduce_perf", "-b", "1M", "-e", "8G", "-f", "2", "-g", "8"]
    # Without an MPI build, the MPI=0 one; without either, no sweep.
    r = _eval(role_eval, hardware, debian_container, SWEEP, exists=(False, True))
    assert r["__binary"] == "/opt/nccl-tests/build/all_reduce_perf"
    r = _eval(role_eval, hardware, debian_container, SWEEP, exists=(False, False))
    assert r["__binary"] == ""
    assert r[_task(_play(), "All-reduce bandwidth sweep")["when"]] is False


@pytest.mark.parametrize(
    ("floor", "stdout", "rc", "passes", "why"),
    [
        (0, SWEEP, 0, True, ""),
        (400, SWEEP, 0, True, ""),
        (450, SWEEP, 0, False, "bus bandwidth 422.73 GB/s at the largest size, below validate_nccl_busbw_min 450"),
        (0, SWEEP.replace("422.73      0", "422.73      3"), 0, False, "1 size(s) with wrong values"),
        (0, "", 1, False, "failed (rc 1): NCCL WARN oops"),
    ],
)
def test_the_floor_fails_a_slow_node(role_eval: Any, hardware: Any, debian_container: dict, floor: float,
                                     stdout: str, rc: int, passes: bool, why: str) -> None:
    r = _eval(role_eval, hardware, debian_container, stdout, rc=rc, validate_nccl_busbw_min=floor)
    result = r["__result"]
    if stdout == SWEEP:
        assert (result["peak_busbw"], result["avg_busbw"], len(result["rows"])) == (422.73, 228.172, 5)
    check = _task(_play(), "The sweep ran")["ansible.builtin.assert"]
    assert all(r[cond] for cond in check["that"]) is passes
    if not passes:
        assert why in r.template(check["fail_msg"])
