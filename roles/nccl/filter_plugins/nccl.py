"""Filters for the nccl role: the compute rails for NCCL_IB_HCA from the node's InfiniBand ports."""

from __future__ import annotations

import re
from typing import Any

# `grep -H . /sys/class/infiniband/<ca>/ports/<n>/{phys_state,link_layer}`: one line per file.
_LINE = re.compile(r"^/sys/class/infiniband/(?P<ca>[^/]+)/ports/(?P<port>\d+)/"
                   r"(?P<key>phys_state|link_layer):(?P<value>.*)$")


def _natural(name: str) -> list[Any]:
    """mlx5_2 before mlx5_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def ib_rails(lines: list[str], exclude: list[str] | None = None) -> list[str]:
    """`<ca>:<port>` of every port whose link layer is InfiniBand and whose link is up (phys_state LinkUp: cabled and
    trained, whether or not a subnet manager has made it Active yet), in adapter order.

    Ethernet link-layer ports (RoCE, BlueField DPUs in their default mode) are not rails; `exclude` names storage
    rails and other adapters NCCL must not use, as `<ca>` (all its ports) or `<ca>:<port>`.
    """
    ports: dict[tuple[str, int], dict[str, str]] = {}
    for line in lines:
        if m := _LINE.match(line.strip()):
            ports.setdefault((m["ca"], int(m["port"])), {})[m["key"]] = m["value"].strip()
    excluded = set(exclude or [])
    rails = []
    for (ca, port), attrs in sorted(ports.items(), key=lambda item: (_natural(item[0][0]), item[0][1])):
        name = f"{ca}:{port}"
        if attrs.get("link_layer") != "InfiniBand" or not attrs.get("phys_state", "").endswith("LinkUp"):
            continue
        if ca in excluded or name in excluded:
            continue
        rails.append(name)
    return rails


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"nccl_ib_rails": ib_rails}
