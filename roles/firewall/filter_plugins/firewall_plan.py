"""The port plan, resolved for one host: `plan | shardstack_firewall_rules(inventory_hostname, groups, hostvars,
zones)`, and the guard that keeps the controller's ssh: `rules | shardstack_firewall_admits(address, port)`.

In Python rather than Jinja because resolving sources (groups, hosts, the admin and client zones, addresses and
networks of both families) and refusing a plan that names something unknown need tests without a running play.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

PROTOCOLS = ("tcp", "udp")
# Source names that stand for a list of networks rather than inventory hosts (firewall_admin_networks,
# firewall_client_networks, resolved by the role).
ZONES = ("admin", "clients")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class PlanError(ValueError):
    pass


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _ports(rule: str, value: Any) -> list[str]:
    """`22`, `"8000-8010"`, a list of those, or `any` (every port) as nft set elements; [] means any."""
    if isinstance(value, str) and value.strip().lower() == "any":
        return []
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        text = str(item).strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
        if not m:
            raise PlanError(f"firewall rule {rule!r}: port {item!r} is not a number, a range a-b, or 'any'")
        low, high = int(m[1]), int(m[2] or m[1])
        if not 1 <= low <= high <= 65535:
            raise PlanError(f"firewall rule {rule!r}: port {text} is outside 1-65535")
        out.append(str(low) if low == high else f"{low}-{high}")
    if not out:
        raise PlanError(f"firewall rule {rule!r}: no port (use 'any' for every port)")
    return sorted(set(out), key=lambda p: int(p.split("-")[0]))


def _network(text: str) -> Network | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _host_networks(host: str, hostvars: Mapping[str, Any]) -> list[Network]:
    """The addresses a host's traffic comes from: `firewall_host_addresses`, else `ansible_host`, else its name;
    names are resolved here, on the controller."""
    hv = hostvars.get(host, {})
    given = hv.get("firewall_host_addresses") or [hv.get("ansible_host") or host]
    out: list[Network] = []
    for entry in given:
        net = _network(str(entry))
        if net is not None:
            out.append(net)
            continue
        try:
            infos = socket.getaddrinfo(str(entry), None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise PlanError(f"host {host}: cannot resolve {entry!r} to an address ({exc}); set ansible_host or "
                            "firewall_host_addresses to its addresses") from exc
        out.extend(ipaddress.ip_network(info[4][0]) for info in infos)
    return out


def _sources(rule: str, names: Any, groups: Mapping[str, Sequence[str]], hostvars: Mapping[str, Any],
             zones: Mapping[str, Sequence[str]]) -> list[Network]:
    if isinstance(names, str):
        names = [names]
    nets: list[Network] = []
    for name in names or []:
        name = str(name)
        if name in ZONES:
            zone = [_network(str(n)) for n in zones.get(name, [])]
            bad = [str(n) for n, z in zip(zones.get(name, []), zone, strict=True) if z is None]
            if bad:
                raise PlanError(f"firewall_{'admin' if name == 'admin' else 'client'}_networks: {bad} are not "
                                "addresses or networks")
            nets.extend(z for z in zone if z is not None)
        elif name in groups:
            for host in groups[name]:
                nets.extend(_host_networks(host, hostvars))
        elif name in hostvars:
            nets.extend(_host_networks(name, hostvars))
        elif (net := _network(name)) is not None:
            nets.append(net)
        else:
            raise PlanError(f"firewall rule {rule!r}: source {name!r} is no inventory group or host, not "
                            f"{' or '.join(ZONES)}, and not an address or network")
    return nets


def _minimal(nets: list[Network]) -> list[str]:
    """Without duplicates and without what a wider network in the list already covers; hosts stay hosts (not
    merged into ranges), so the file reads as the inventory does."""
    kept: list[Network] = []
    for net in sorted(set(nets), key=lambda n: (n.prefixlen, n)):
        if not any(net.subnet_of(k) for k in kept):  # type: ignore[arg-type]
            kept.append(net)
    return [str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n) for n in sorted(kept)]


def host_rules(plan: Sequence[Mapping[str, Any]], host: str, groups: Mapping[str, Sequence[str]],
               hostvars: Mapping[str, Any], zones: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """The rules of the plan that apply to `host` (it is in one of their `to` groups or named there), one per
    protocol, with their sources resolved to IPv4 and IPv6 networks. A rule whose sources resolve to nothing is
    kept with empty lists: the template says so instead of writing a rule that admits nobody."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entry in plan:
        name = str(entry.get("name") or "")
        if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._/-]{0,63}", name):
            raise PlanError(f"firewall rule {entry!r}: `name` must be 1-64 letters, digits, spaces or ._/-")
        if name in seen:
            raise PlanError(f"firewall rule {name!r} is defined twice")
        seen.add(name)
        unknown = set(entry) - {"name", "port", "proto", "to", "from", "enabled"}
        if unknown:
            raise PlanError(f"firewall rule {name!r}: unknown key(s) {sorted(unknown)}")
        if not _truthy(entry.get("enabled", True)):
            continue
        protos = entry.get("proto", "tcp")
        protos = [str(p).lower() for p in (protos if isinstance(protos, list | tuple) else [protos])]
        if not protos or set(protos) - set(PROTOCOLS):
            raise PlanError(f"firewall rule {name!r}: proto {entry.get('proto')!r} is not tcp, udp or a list of them")
        if "port" not in entry:
            raise PlanError(f"firewall rule {name!r}: no `port`")
        ports = _ports(name, entry["port"])
        targets = entry.get("to") or []
        targets = [targets] if isinstance(targets, str) else targets
        for t in targets:
            if t not in groups and t not in hostvars:
                raise PlanError(f"firewall rule {name!r}: `to` {t!r} is no inventory group or host")
        if not any(host == t or host in groups.get(t, ()) for t in targets):
            continue
        nets = _sources(name, entry.get("from"), groups, hostvars, zones)
        v4 = [n for n in nets if n.version == 4]
        v6 = [n for n in nets if n.version == 6]
        out.extend({
            "name": name,
            "proto": proto,
            "ports": ports,
            "ipv4": _minimal(v4),
            "ipv6": _minimal(v6),
        } for proto in dict.fromkeys(protos))
    return out


def admits(rules: Sequence[Mapping[str, Any]], address: str, port: Any, proto: str = "tcp") -> list[str]:
    """Names of the rules that let `address` reach `port`/`proto` (the lockout guard: the connection Ansible uses
    must be one of them before the ruleset is applied)."""
    addr = ipaddress.ip_address(str(address).split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    port = int(port)
    names = []
    for rule in rules:
        if rule["proto"] != proto:
            continue
        in_ports = not rule["ports"] or any(
            int(p.split("-")[0]) <= port <= int(p.split("-")[-1]) for p in rule["ports"])
        nets = rule["ipv4"] if addr.version == 4 else rule["ipv6"]
        if in_ports and any(addr in ipaddress.ip_network(n) for n in nets):
            names.append(rule["name"])
    return names


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_firewall_rules": host_rules, "shardstack_firewall_admits": admits}
