"""The firewall role: the port plan resolved per host, the lockout guard, the rendered nftables file checked by the
kernel's own parser (`nft -c -f`, as root on the host), and the plan kept in step with every role's ports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.plugins.loader import filter_loader
from ansible_vars import load_module

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
FILTERS = ROLES / "firewall" / "filter_plugins"
# The role's filters, for RoleEval's Templar as for a play.
filter_loader.add_directory(str(FILTERS))

plan = load_module(FILTERS / "firewall_plan.py")

SAMPLE = yaml.safe_load((REPO / "inventory" / "sample" / "hosts.yml").read_text())["all"]


def _inventory(inv: dict) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """groups and hostvars of a YAML inventory (two levels: all → children → hosts)."""
    groups: dict[str, list[str]] = {"all": []}
    hostvars: dict[str, dict[str, Any]] = {}
    for name, child in inv["children"].items():
        groups[name] = list(child["hosts"])
        for host, hv in child["hosts"].items():
            hostvars.setdefault(host, {}).update(hv or {})
            if host not in groups["all"]:
                groups["all"].append(host)
    return groups, hostvars


GROUPS, HOSTVARS = _inventory(SAMPLE)
CONTROLLER = "198.51.100.7 50022 22"  # SSH_CLIENT as the node sees it


def _eval(role_eval: Any, facts: dict, host: str, **overrides: Any) -> Any:
    variables = {"groups": GROUPS, "hostvars": HOSTVARS, "__firewall_ssh_client": {"stdout": CONTROLLER}, **overrides}
    return role_eval("firewall", facts, inventory_hostname=host, **variables)


def _rules(role_eval: Any, facts: dict, host: str, **overrides: Any) -> dict[str, dict]:
    return {f"{r['name']}/{r['proto']}": r for r in _eval(role_eval, facts, host, **overrides)["__firewall_rules"]}


def test_defaults_resolve_the_sample_inventory(role_eval: Any, debian_container: dict) -> None:
    gpu01 = _rules(role_eval, debian_container, "gpu01")  # a train node
    assert gpu01["ssh/tcp"] == {"name": "ssh", "proto": "tcp", "ports": ["22"], "ipv4": ["198.51.100.7"],
                                "ipv6": []}
    assert gpu01["torch rendezvous/tcp"]["ports"] == ["29400", "29401"]
    assert gpu01["torch rendezvous/tcp"]["ipv4"] == ["192.0.2.11", "192.0.2.12"]
    assert gpu01["train mesh/tcp"]["ports"] == []  # any port among train nodes
    assert gpu01["node_exporter/tcp"]["ipv4"] == gpu01["trainer metrics/tcp"]["ipv4"] == ["192.0.2.31"]
    assert "inference/tcp" not in gpu01 and "prometheus/tcp" not in gpu01
    gpu03 = _rules(role_eval, debian_container, "gpu03")  # an inference node: no rendezvous, no mesh
    assert set(gpu03) == {"ssh/tcp", "inference/tcp", "node_exporter/tcp", "dcgm-exporter/tcp"}
    # ops01 is both the load balancer and the monitoring server: it reaches the backends for both reasons.
    # ... and the admin networks reach it for /health (rollouts, molecule's verify).
    assert gpu03["inference/tcp"]["ipv4"] == ["192.0.2.31", "198.51.100.7"]
    assert gpu03["inference/tcp"]["ports"] == ["8000"]
    ops01 = _rules(role_eval, debian_container, "ops01")
    # Clients default to the admin networks, which default to the controller.
    assert ops01["load balancer/tcp"]["ipv4"] == ops01["grafana/tcp"]["ipv4"] == ["198.51.100.7"]
    assert ops01["prometheus/tcp"]["ipv4"] == ["192.0.2.31", "198.51.100.7"]
    assert "alertmanager cluster/tcp" not in ops01
    store01 = _rules(role_eval, debian_container, "store01")
    assert store01["nfs/tcp"]["ports"] == ["2049"]
    # ... from the hosts that mount it: not ops01, the load balancer and monitoring host.
    assert store01["nfs/tcp"]["ipv4"] == ["192.0.2.11", "192.0.2.12", "192.0.2.13", "192.0.2.14", "192.0.2.21"]


def test_a_changed_port_moves_its_rule(role_eval: Any, debian_container: dict) -> None:
    rules = _rules(role_eval, debian_container, "ops01", loadbalancer_port=9080, prometheus_port=19090,
                   shared_storage_backend="bind",
                   prometheus_alertmanager_cluster_listen_address="0.0.0.0:9494")
    assert rules["load balancer/tcp"]["ports"] == ["443", "9080"] and rules["prometheus/tcp"]["ports"] == ["19090"]
    assert rules["alertmanager cluster/tcp"]["ports"] == rules["alertmanager cluster/udp"]["ports"] == ["9494"]
    store = _rules(role_eval, debian_container, "store01", shared_storage_backend="bind")
    assert "nfs/tcp" not in store


def test_admin_and_client_networks_of_both_families(role_eval: Any, debian_container: dict) -> None:
    rules = _rules(role_eval, debian_container, "ops01",
                   firewall_admin_networks=["10.1.0.0/16", "10.1.2.3", "2001:db8::/48"],
                   firewall_client_networks=["0.0.0.0/0", "::/0"])
    assert rules["ssh/tcp"]["ipv4"] == ["10.1.0.0/16"]  # collapsed: 10.1.2.3 is inside
    assert rules["ssh/tcp"]["ipv6"] == ["2001:db8::/48"]
    assert rules["load balancer/tcp"]["ipv4"] == ["0.0.0.0/0"] and rules["load balancer/tcp"]["ipv6"] == ["::/0"]


def test_the_guard_names_the_rules_that_admit_a_connection(role_eval: Any, debian_container: dict) -> None:
    rules = list(_rules(role_eval, debian_container, "gpu01").values())
    assert plan.admits(rules, "198.51.100.7", 22) == ["ssh"]
    assert plan.admits(rules, "::ffff:198.51.100.7", "22") == ["ssh"]
    assert plan.admits(rules, "198.51.100.8", 22) == []  # another address: locked out
    assert plan.admits(rules, "198.51.100.7", 2222) == []  # sshd on another port than the plan's
    assert plan.admits(rules, "192.0.2.12", 22) == ["train mesh"]  # a peer train node: any TCP port
    assert plan.admits(rules, "192.0.2.12", 29400, "udp") == []


def test_the_guard_refuses_a_plan_that_drops_the_controller(role_eval: Any, debian_container: dict) -> None:
    ev = _eval(role_eval, debian_container, "gpu01", firewall_admin_networks=["10.9.0.0/16"])
    assert ev["__firewall_rules | shardstack_firewall_admits('198.51.100.7', 22)"] == []
    # Without ssh (a local connection) the controller's address is unknown: no admin zone at all.
    local = _eval(role_eval, debian_container, "gpu01", __firewall_ssh_client={"stdout": "", "rc": 1})
    assert local["__firewall_zones.admin"] == []


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "x", "port": 70000, "to": ["all"], "from": ["admin"]}, "outside 1-65535"),
    ({"name": "x", "port": "http", "to": ["all"], "from": ["admin"]}, "not a number"),
    ({"name": "x", "port": 1, "proto": "sctp", "to": ["all"], "from": ["admin"]}, "not tcp, udp"),
    ({"name": "x", "port": 1, "to": ["trian_nodes"], "from": ["admin"]}, "`to` 'trian_nodes'"),
    ({"name": "x", "port": 1, "to": ["all"], "from": ["monitoring"]}, "source 'monitoring'"),
    ({"name": "x", "port": 1, "to": ["all"], "form": ["admin"]}, "unknown key(s) ['form']"),
    ({"name": "ssh", "port": 1, "to": ["all"], "from": ["admin"]}, "defined twice"),
    ({"name": 'say "hi"', "port": 1, "to": ["all"], "from": ["admin"]}, "`name` must be"),
])
def test_a_broken_plan_entry_is_refused_with_its_name(entry: dict, message: str) -> None:
    ssh = {"name": "ssh", "port": 22, "to": ["all"], "from": ["admin"]}
    with pytest.raises(plan.PlanError, match=re.escape(message)):
        plan.host_rules([ssh, entry], "gpu01", GROUPS, HOSTVARS, {"admin": ["10.0.0.1"], "clients": []})


def test_host_addresses_override_and_names_resolve() -> None:
    hostvars = {**HOSTVARS, "gpu02": {"ansible_host": "localhost"},
                "gpu01": {"ansible_host": "192.0.2.11", "firewall_host_addresses": ["10.8.0.11", "fd00::11"]}}
    rules = plan.host_rules([{"name": "mesh", "port": "any", "to": ["train_nodes"], "from": ["train_nodes"]}],
                            "gpu01", GROUPS, hostvars, {})
    assert "10.8.0.11" in rules[0]["ipv4"] and "127.0.0.1" in rules[0]["ipv4"]
    assert "192.0.2.11" not in rules[0]["ipv4"] and rules[0]["ipv6"][0] == "fd00::11"


def _nft_check(path: Path) -> subprocess.CompletedProcess:
    nft = shutil.which("nft")
    assert nft, "nft is missing: `make setup` installs nftables"
    return subprocess.run([nft, "-c", "-f", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("host", sorted(HOSTVARS))
def test_rendered_ruleset_passes_nft_check(host: str, role_eval: Any, debian_container: dict,
                                           tmp_path: Path) -> None:
    ev = _eval(role_eval, debian_container, host, firewall_admin_networks=["198.51.100.0/24", "2001:db8::/48"])
    text = ev.render("shardstack.nft.j2")
    assert text.startswith("#")
    assert "table inet shardstack\ndelete table inet shardstack\n" in text  # replaces only its own table
    assert "policy drop;" in text and "flush ruleset" not in text
    assert 'ip6 saddr { 2001:db8::/48 } tcp dport { 22 } accept comment "ssh"' in text
    path = tmp_path / "shardstack.nft"
    path.write_text(text)
    proc = _nft_check(path)
    assert proc.returncode == 0, proc.stderr
    # The check is real: the same file with one broken rule is refused.
    path.write_text(text.replace("tcp dport { 22 }", "tcp dport { 22- }"))
    assert _nft_check(path).returncode != 0


def test_firewall_unit_loads_and_reloads_the_file(role_eval: Any, debian_container: dict) -> None:
    unit = _eval(role_eval, debian_container, "gpu01").render("shardstack-firewall.service.j2")
    assert "ExecStart=/usr/sbin/nft -f /etc/nftables.d/shardstack.nft" in unit
    assert "ExecReload=/usr/sbin/nft -f /etc/nftables.d/shardstack.nft" in unit
    assert "\nExecStop=" not in unit  # stopping never opens the node
    assert "Before=network-pre.target" in unit


# --- the plan and the other roles' ports --------------------------------------------------------------------

# `*_port` variables that are not a listening port of the role's own host, or are covered another way.
NOT_A_LISTENER = {
    "loadbalancer_backend_port": "the port HAProxy connects to on the backends (the inference rule's port)",
    "rdma_verify_ports": "a switch (check InfiniBand port states), not a network port",
    "rdma_required_ports": "how many InfiniBand/RoCE ports must be Active, not a network port",
}
PLAN_TEXT = (ROLES / "firewall" / "defaults" / "main.yml").read_text()


def _role_defaults() -> dict[str, dict]:
    out = {}
    for role in sorted(ROLES.iterdir()):
        path = role / "defaults" / "main.yml"
        if path.is_file() and role.name != "firewall":
            out[role.name] = yaml.safe_load(path.read_text()) or {}
    return out


def test_every_role_port_is_in_the_plan() -> None:
    """docs/design.md: every listening port is in the firewall's plan. A role that adds a `<role>_port` variable
    (or `_ports`) without a plan entry referencing it fails here."""
    ports = sorted(k for d in _role_defaults().values() for k in d if re.search(r"_ports?$", k))
    assert ports, "no port variables found"
    missing = [k for k in ports if k not in NOT_A_LISTENER and not re.search(r"\{\{\s*" + k + r"\b", PLAN_TEXT)]
    assert not missing, f"ports without a firewall_port_plan entry (roles/firewall/defaults/main.yml): {missing}"


def test_plan_fallbacks_equal_the_roles_defaults() -> None:
    """`{{ loadbalancer_port | default(80) }}` must say what the loadbalancer role says, or the firewall opens
    another port than the service listens on whenever the role is not in the same play."""
    defaults = {k: v for d in _role_defaults().values() for k, v in d.items()}
    refs = re.findall(r"\{\{\s*(\w+)\s*\|\s*default\(([^)]*)\)", PLAN_TEXT)
    # The cluster address is "" (off) by default; the plan's ':9094' only gives the disabled rule a port.
    compared = [(n, yaml.safe_load(f), defaults[n]) for n, f in refs
                if n in defaults and n != "prometheus_alertmanager_cluster_listen_address"]
    assert [c for c in compared if c[1] != c[2]] == []
    assert len(compared) >= 9, refs
    # validate.yml's rendezvous port is an extra var of that playbook, not a role's.
    assert "validate_rdzv_port | default(29401)" in PLAN_TEXT
    assert "validate_rdzv_port | default(29401)" in (REPO / "playbooks" / "validate.yml").read_text()


def test_every_cluster_flow_is_admitted(role_eval: Any, debian_container: dict) -> None:
    """The traffic site.yml's cluster needs, on the sample inventory: every Prometheus scrape (the prometheus role's
    own job list), HAProxy to its backends, training between train nodes, NFS, and the controller's checks
    (molecule's default verify and tests/e2e: ssh, /health on the backends, the load balancer, its stats,
    Prometheus' API)."""
    facts = debian_container
    rules = {h: _eval(role_eval, facts, h)["__firewall_rules"] for h in HOSTVARS}
    addr = {h: hv["ansible_host"] for h, hv in HOSTVARS.items()}
    prom = yaml.safe_load((ROLES / "prometheus" / "defaults" / "main.yml").read_text())["prometheus_scrape_jobs"]
    flows = [(src, dst, job["port"], f"scrape {job['name']}") for job in prom for g in job["groups"]
             for dst in GROUPS[g] for src in GROUPS["monitoring_server"]]
    flows += [(lb, b, 8000, "haproxy to a backend") for lb in GROUPS["loadbalancer"] for b in GROUPS["inference_nodes"]]
    flows += [(a, b, p, "training") for a in GROUPS["train_nodes"] for b in GROUPS["train_nodes"] if a != b
              for p in (29400, 29401, 40123)]
    mounts = {h for g in ("storage_server", "train_nodes", "inference_nodes") for h in GROUPS[g]}
    flows += [(h, s, 2049, "nfs") for h in mounts for s in GROUPS["storage_server"] if h != s]
    controller = CONTROLLER.split()[0]
    flows += [(controller, h, 22, "ssh") for h in HOSTVARS]
    flows += [(controller, h, 8000, "verify /health") for h in GROUPS["inference_nodes"]]
    flows += [(controller, h, p, "verify, e2e") for h in GROUPS["loadbalancer"] for p in (80, 443, 8404, 8405)]
    flows += [(controller, h, 9090, "e2e queries") for h in GROUPS["monitoring_server"]]
    refused = [f for f in flows if f[0] != f[1]
               and not plan.admits(rules[f[1]], addr.get(f[0], f[0]), f[2])]
    assert not refused, refused
    assert len(flows) > 30
    # ... and what the plan keeps out: a train node reaching a backend or an exporter, the controller an exporter.
    assert plan.admits(rules["gpu03"], addr["gpu01"], 8000) == []
    assert plan.admits(rules["gpu01"], controller, 9100) == []
    assert plan.admits(rules["gpu03"], addr["gpu04"], 9100) == []
    # ... and the load balancer / monitoring host, which mounts nothing, reaching the export.
    assert plan.admits(rules["store01"], addr["ops01"], 2049) == []


def test_preflight_knows_the_firewall_variables() -> None:
    """site.yml's preflight rejects unknown `<role>_*` variables: the firewall's are known, a typo is not."""
    inv = load_module(REPO / "playbooks/filter_plugins/shardstack_inventory.py")
    catalog = inv.known_variables(str(REPO))
    assert {"firewall_admin_networks", "firewall_port_plan", "firewall_extra_rules"} <= set(catalog["known"])
    assert inv.unknown_variables(["firewall_admin_network"], catalog) == [
        "firewall_admin_network (did you mean firewall_admin_networks?)"]


# --- the ruleset applied for real, in network namespaces ----------------------------------------------------

# Three namespaces joined by veth pairs: `srv` (an inference node, gets the ruleset), `mon` (the monitoring server)
# and `peer` (a train node, which the plan names as the admin network here). Only namespace addresses are used.
NETNS_HOSTS = {"srv": "10.250.1.1", "mon": "10.250.1.2", "peer": "10.250.2.2"}
CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("open")
except socket.timeout:
    print("dropped")
except OSError as e:
    print(type(e).__name__)
"""
LISTEN = """
import socket, sys, time
socks = []
for port in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(port)))
    s.listen(16)
    socks.append(s)
print("listening", flush=True)
time.sleep(120)
"""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert proc.returncode == 0, f"ip {' '.join(args)}: {proc.stderr}"


@pytest.fixture
def netns() -> Iterator[dict[str, str]]:
    """{'srv': name, 'mon': name, 'peer': name}: namespaces named after this process, removed afterwards."""
    tag = f"ssfw{os.getpid() % 100000}"
    names = {role: f"{tag}-{role}" for role in NETNS_HOSTS}
    try:
        for name in names.values():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        for i, other in enumerate(("mon", "peer"), start=1):
            a, b = f"{tag}s{i}", f"{tag}o{i}"
            _ip("link", "add", a, "netns", names["srv"], "type", "veth", "peer", "name", b, "netns", names[other])
            _ip("-n", names["srv"], "addr", "add", f"10.250.{i}.1/24", "dev", a)
            _ip("-n", names[other], "addr", "add", f"{NETNS_HOSTS[other]}/24", "dev", b)
            _ip("-n", names["srv"], "link", "set", a, "up")
            _ip("-n", names[other], "link", "set", b, "up")
        yield names
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _connect(ns: str, address: str, port: int, timeout: float = 1.5) -> str:
    proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CONNECT, address, str(port),
                           str(timeout)], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() or proc.stderr


def test_ruleset_applied_in_a_namespace_admits_the_plan_and_drops_the_rest(
        netns: dict[str, str], role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    groups = {"all": list(NETNS_HOSTS), "train_nodes": ["peer"], "inference_nodes": ["srv"],
              "monitoring_server": ["mon"], "loadbalancer": [], "storage_server": []}
    hostvars = {h: {"ansible_host": a} for h, a in NETNS_HOSTS.items()}
    ev = role_eval("firewall", debian_container, inventory_hostname="srv", groups=groups, hostvars=hostvars,
                   ansible_port=2222, firewall_admin_networks=[NETNS_HOSTS["peer"]],
                   __firewall_ssh_client={"stdout": ""})
    rules = tmp_path / "shardstack.nft"
    rules.write_text(ev.render("shardstack.nft.j2"))
    srv = netns["srv"]
    for _ in range(2):  # loading twice replaces the table (the reload path), it does not add a second one
        proc = subprocess.run(["ip", "netns", "exec", srv, "nft", "-f", str(rules)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    listener = subprocess.Popen(["ip", "netns", "exec", srv, sys.executable, "-c", LISTEN, "2222", "8000", "9100",
                                 "9999"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout and listener.stdout.readline().strip() == "listening"
        got = {
            "mon -> node_exporter": _connect(netns["mon"], NETNS_HOSTS["srv"], 9100),
            "mon -> inference": _connect(netns["mon"], NETNS_HOSTS["srv"], 8000),
            "peer -> ssh (admin)": _connect(netns["peer"], "10.250.2.1", 2222),
            "peer -> node_exporter": _connect(netns["peer"], "10.250.2.1", 9100),
            "peer -> inference (admin)": _connect(netns["peer"], "10.250.2.1", 8000),
            "mon -> ssh": _connect(netns["mon"], NETNS_HOSTS["srv"], 2222),
            "mon -> unplanned port": _connect(netns["mon"], NETNS_HOSTS["srv"], 9999),
            "srv -> itself over loopback": _connect(srv, "127.0.0.1", 9999),
        }
    finally:
        listener.kill()
        listener.wait()
    assert got == {
        "mon -> node_exporter": "open", "mon -> inference": "open", "peer -> ssh (admin)": "open",
        "peer -> node_exporter": "dropped", "peer -> inference (admin)": "open", "mon -> ssh": "dropped",
        "mon -> unplanned port": "dropped", "srv -> itself over loopback": "open",
    }
    table = subprocess.run(["ip", "netns", "exec", srv, "nft", "list", "table", "inet", "shardstack"],
                           capture_output=True, text=True).stdout
    assert table.count("chain input") == 1
    dropped = re.search(r'counter packets (\d+) bytes \d+ comment "dropped"', table)
    assert dropped and int(dropped[1]) >= 3, table


def test_nfs_in_a_namespace_reaches_the_storage_server_only_from_the_hosts_that_mount(
        netns: dict[str, str], role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    """Least privilege on the wire: the storage server's ruleset admits 2049 from a train node and drops it from the
    load balancer / monitoring host (which mounts nothing), with the NFS backend's rule enabled."""
    groups = {"all": list(NETNS_HOSTS), "storage_server": ["srv"], "train_nodes": ["peer"], "inference_nodes": [],
              "monitoring_server": ["mon"], "loadbalancer": ["mon"]}
    hostvars = {h: {"ansible_host": a} for h, a in NETNS_HOSTS.items()}
    ev = role_eval("firewall", debian_container, inventory_hostname="srv", groups=groups, hostvars=hostvars,
                   shared_storage_backend="nfs", firewall_admin_networks=["192.0.2.1"],
                   __firewall_ssh_client={"stdout": ""})
    rules = tmp_path / "shardstack.nft"
    rules.write_text(ev.render("shardstack.nft.j2"))
    srv = netns["srv"]
    proc = subprocess.run(["ip", "netns", "exec", srv, "nft", "-f", str(rules)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    listener = subprocess.Popen(["ip", "netns", "exec", srv, sys.executable, "-c", LISTEN, "2049"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout and listener.stdout.readline().strip() == "listening"
        got = {"train node": _connect(netns["peer"], "10.250.2.1", 2049),
               "load balancer and monitoring": _connect(netns["mon"], NETNS_HOSTS["srv"], 2049)}
    finally:
        listener.kill()
        listener.wait()
    assert got == {"train node": "open", "load balancer and monitoring": "dropped"}


def test_slurm_ports_open_only_with_slurm_as_the_scheduler(role_eval: Any, debian_container: dict) -> None:
    """slurmctld and slurmdbd on the controller, slurmd and srun's step ports on the train nodes: their rules exist
    only where shardstack_scheduler is slurm, and admit the Slurm hosts (and the admins for the controller's)."""
    slurm = ("slurmctld/tcp", "slurmd/tcp", "slurmdbd/tcp", "srun/tcp")
    for host in HOSTVARS:
        assert not set(slurm) & set(_rules(role_eval, debian_container, host)), host
    ops01 = _rules(role_eval, debian_container, "ops01", shardstack_scheduler="slurm")
    gpu01 = _rules(role_eval, debian_container, "gpu01", shardstack_scheduler="slurm")
    controller, train = "198.51.100.7", ["192.0.2.11", "192.0.2.12"]
    assert ops01["slurmctld/tcp"] == {"name": "slurmctld", "proto": "tcp", "ports": ["6817"],
                                      "ipv4": sorted(["192.0.2.31", *train, controller]), "ipv6": []}
    assert ops01["slurmdbd/tcp"]["ports"] == ["6819"] and ops01["slurmdbd/tcp"]["ipv4"] == ["192.0.2.31", controller]
    assert ops01["srun/tcp"]["ports"] == gpu01["srun/tcp"]["ports"] == ["60001-60100"]
    assert gpu01["slurmd/tcp"]["ports"] == ["6818"] and gpu01["slurmd/tcp"]["ipv4"] == sorted(["192.0.2.31", *train])
    assert "slurmctld/tcp" not in gpu01 and "slurmd/tcp" not in ops01
    # An inference node takes no part in Slurm.
    assert not set(slurm) & set(_rules(role_eval, debian_container, "gpu03", shardstack_scheduler="slurm"))
    moved = _rules(role_eval, debian_container, "ops01", shardstack_scheduler="slurm", slurm_slurmctld_port=7817)
    assert moved["slurmctld/tcp"]["ports"] == ["7817"]


def test_ray_ports_open_only_between_the_nodes_of_a_pipeline_parallel_replica(
        role_eval: Any, debian_container: dict) -> None:
    """vLLM pipeline parallel across nodes: Ray's GCS, node and object manager ports and its bounded worker range,
    plus any port for the stages' NCCL, between the nodes of the replica group and nobody else; no rule at all
    without pipeline parallel."""
    for host in HOSTVARS:
        assert not {"ray/tcp", "pipeline mesh/tcp"} & set(_rules(role_eval, debian_container, host)), host
    groups = {**GROUPS, "replica_a": ["gpu03", "gpu04"]}
    pp = {"groups": groups, "inference_service_engine": "vllm", "inference_service_pipeline_parallel": 2,
          "inference_service_replica_group": "replica_a"}
    gpu04 = _rules(role_eval, debian_container, "gpu04", **pp)
    assert gpu04["ray/tcp"] == {"name": "ray", "proto": "tcp", "ports": ["6379", "6380", "6381", "10002-10101"],
                                "ipv4": ["192.0.2.13", "192.0.2.14"], "ipv6": []}
    assert gpu04["pipeline mesh/tcp"]["ports"] == [] and gpu04["pipeline mesh/tcp"]["ipv4"] == ["192.0.2.13",
                                                                                               "192.0.2.14"]
    rules = list(gpu04.values())
    assert plan.admits(rules, "192.0.2.13", 6379) == ["ray", "pipeline mesh"]
    assert plan.admits(rules, "192.0.2.11", 6379) == []  # a train node
    assert plan.admits(rules, "198.51.100.7", 10050) == []  # the controller: no dashboard, no Ray client
    moved = _rules(role_eval, debian_container, "gpu03", **pp, inference_service_ray_port=7379,
                   inference_service_ray_worker_ports="20000-20031")
    assert moved["ray/tcp"]["ports"] == ["6380", "6381", "7379", "20000-20031"]
    # The builtin engine has no pipeline parallel (its preflight refuses it): no Ray rule either.
    builtin = _rules(role_eval, debian_container, "gpu03", **{**pp, "inference_service_engine": "builtin"})
    assert "ray/tcp" not in builtin


def test_the_pipeline_ruleset_passes_nft_check(role_eval: Any, debian_container: dict, tmp_path: Path) -> None:
    ev = _eval(role_eval, debian_container, "gpu03", groups={**GROUPS, "replica_a": ["gpu03", "gpu04"]},
               inference_service_engine="vllm", inference_service_pipeline_parallel=2,
               inference_service_replica_group="replica_a")
    text = ev.render("shardstack.nft.j2")
    assert ('ip saddr { 192.0.2.13, 192.0.2.14 } tcp dport { 6379, 6380, 6381, 10002-10101 } accept comment "ray"'
            in text)
    path = tmp_path / "shardstack.nft"
    path.write_text(text)
    proc = _nft_check(path)
    assert proc.returncode == 0, proc.stderr
