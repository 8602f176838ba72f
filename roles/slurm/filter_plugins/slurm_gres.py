"""Filters of the slurm role: a compute node's GPUs as gres.conf lines want them, with the cores near each GPU."""

from __future__ import annotations

import re
from typing import Any


def _cpulist(text: str) -> list[int]:
    """A kernel CPU list ("0-55,112-167") as CPU numbers; [] when it is not one."""
    out: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            return []
        lo = int(m[1])
        out.extend(range(lo, int(m[2] or lo) + 1))
    return out


def _ranges(numbers: list[int]) -> str:
    """Sorted numbers as a Slurm/kernel range list: [0, 1, 2, 5] → "0-2,5"."""
    out: list[str] = []
    for n in sorted(set(numbers)):
        if out and n == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ",".join(out)


def gres_gpus(lines: list[str], hardware: dict[str, Any], cores_total: Any = 0) -> list[dict[str, str]]:
    """This node's GPUs for gres.conf: [{"file": "/dev/nvidia<N>", "cores": "0-55" or ""}].

    The GPUs are the probe's NVIDIA display/3D PCI functions (class 0x03; NVSwitches are bridges, 0x0680), so the
    count is right on the first run, before a driver has created /dev/nvidia<N>; the driver numbers its device files
    in PCI order, which is the probe's (sorted by address). Without PCI functions (nothing to read them from), the
    device files found. `lines` are `grep -H .` of each GPU's local_cpulist and every CPU's
    topology/{physical_package_id,core_id} (configure.yml). Cores= is Slurm's logical core index (cores numbered
    socket by socket, in CPU order within each), so CPU numbers are mapped through the topology. It stays empty when
    the topology is incomplete, disagrees with slurmd's core count (`cores_total`), or the GPU is near every core:
    no binding then, rather than a wrong one.
    """
    functions = list(hardware.get("nvidia_gpu_functions") or [])
    if not functions:
        nodes = sorted(hardware.get("nvidia_device_nodes") or [], key=lambda p: int(re.sub(r"\D", "", p) or 0))
        return [{"file": n, "cores": ""} for n in nodes]
    local: dict[str, str] = {}
    cpu: dict[int, dict[str, int]] = {}
    for line in lines:
        path, sep, value = line.rpartition(":")  # PCI addresses hold colons
        if not sep:
            continue
        if path.endswith("/local_cpulist"):
            local[path.removesuffix("/local_cpulist")] = value
            continue
        m = re.search(r"/cpu(\d+)/topology/(physical_package_id|core_id)$", path)
        if m and re.fullmatch(r"-?\d+", value.strip()):
            cpu.setdefault(int(m[1]), {})[m[2]] = int(value)
    # (package, core) of each CPU; a core's place: packages in order, cores by their first CPU within each.
    core_of = {n: (t["physical_package_id"], t["core_id"]) for n, t in cpu.items() if len(t) == 2}
    first_cpu: dict[tuple[int, int], int] = {}
    for n, core in sorted(core_of.items()):
        first_cpu.setdefault(core, n)
    order = sorted(first_cpu, key=lambda c: (c[0], first_cpu[c]))
    index = {core: i for i, core in enumerate(order)}
    usable = len(core_of) == len(cpu) and len(order) > 0 and len(order) == int(cores_total or 0)
    out = []
    for i, fn in enumerate(functions):
        cpus = _cpulist(local.get(fn, ""))
        cores: list[int] = []
        if usable and cpus and all(n in core_of for n in cpus):
            cores = sorted({index[core_of[n]] for n in cpus})
        out.append({"file": f"/dev/nvidia{i}", "cores": _ranges(cores) if 0 < len(cores) < len(order) else ""})
    return out


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"slurm_gres_gpus": gres_gpus}
