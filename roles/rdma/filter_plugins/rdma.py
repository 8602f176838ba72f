"""Filters for the rdma role: turn `ibstat` output into data the port check can assert on."""

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


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"rdma_parse_ibstat": parse_ibstat}
