"""Filters for the rdma role: `ibstat` output as data, and the port check on it (required ports from the inventory)."""

from __future__ import annotations

import re
from typing import Any

_CA = re.compile(r"^CA '(?P<ca>[^']+)'")
_PORT = re.compile(r"^\s+Port (?P<port>\d+):\s*$")
_FIELD = re.compile(r"^\s+(?P<key>[A-Za-z ]+):\s*(?P<value>.*?)\s*$")
# ibstat's labels -> the keys the role's assertions use.
_KEYS = {"State": "state", "Physical state": "physical", "Rate": "rate", "Link layer": "link_layer"}


def parse_ibstat(text: str) -> list[dict[str, Any]]:
    """One dict per port: ca, port, state, physical, rate (Gb/s, float), link_layer.

    Fields outside a `Port N:` block (firmware, GUIDs) belong to the adapter and are ignored.
    """
    ports: list[dict[str, Any]] = []
    ca: str | None = None
    port: dict[str, Any] | None = None
    for line in text.splitlines():
        if m := _CA.match(line):
            ca, port = m["ca"], None
        elif (m := _PORT.match(line)) and ca is not None:
            port = {"ca": ca, "port": int(m["port"]), "state": "", "physical": "", "rate": 0.0, "link_layer": ""}
            ports.append(port)
        elif port is not None and (m := _FIELD.match(line)) and m["key"] in _KEYS:
            key = _KEYS[m["key"]]
            port[key] = float(m["value"]) if key == "rate" else m["value"]
    return ports


def _name(port: dict[str, Any]) -> str:
    return f"{port['ca']}/{port['port']}"


def check_ports(ports: list[dict[str, Any]], required: list[str], min_rate_gbps: float = 0) -> dict[str, list[str]]:
    """Judge parsed ports against the inventory: {"problems": [...], "report": [...]}.

    Only the `required` ports (`<ca>/<port>`, e.g. mlx5_0/1) must be Active/LinkUp at `min_rate_gbps` or more; a
    required port the node does not have is a problem too. Every other port, a spare or uncabled one, is reported
    with its state and never fails the node.
    """
    by_name = {_name(p): p for p in ports}
    problems = [f"required port {name} not found (the node has {', '.join(sorted(by_name)) or 'no port'})"
                for name in required if name not in by_name]
    report = []
    for name, p in sorted(by_name.items()):
        state = f"{p['state'] or '?'}/{p['physical'] or '?'} {p['rate']:g} Gb/s {p['link_layer']}".rstrip()
        if name not in required:
            report.append(f"{name}: {state} (not required)")
        elif p["state"] != "Active" or p["physical"] != "LinkUp":
            problems.append(f"required port {name} is {state}, not Active/LinkUp")
        elif p["rate"] < min_rate_gbps:
            problems.append(f"required port {name} runs at {p['rate']:g} Gb/s, below rdma_min_rate_gbps "
                            f"{min_rate_gbps:g}")
        else:
            report.append(f"{name}: {state} (required)")
    return {"problems": problems, "report": report}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"rdma_parse_ibstat": parse_ibstat, "rdma_check_ports": check_ports}
