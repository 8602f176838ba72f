"""The lab boots real systemd nodes, connects them, gives them apt through the proxy, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from shardstack.errors import ShardstackError
from shardstack.lab import image, lab
from shardstack.lab.inventory import group_layout, omp_threads
from shardstack.lab.node import is_zombie

pytestmark = pytest.mark.lab


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "shardstack", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"shardstack {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def unique_name() -> str:
    return "t" + uuid.uuid4().hex[:6]


@pytest.fixture
def two_nodes(tmp_path: Path):
    name = unique_name()
    inventory = tmp_path / "hosts.yml"
    cli("lab", "up", "--name", name, "--nodes", "2", "--write-inventory", str(inventory))
    try:
        yield name, inventory
    finally:
        cli("lab", "down", "--name", name, check=False)
    assert lab.leftovers(name) == []


def node_exec(name: str, node: str, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstack", "lab", "exec", "--name", name, node, "--",
                           "sh", "-c", script], capture_output=True, text=True, timeout=timeout)


def test_two_nodes_talk_tcp_install_packages_and_leave_nothing(two_nodes) -> None:
    name, inventory = two_nodes
    status = json.loads(cli("lab", "status", "--name", name, "--json").stdout)
    assert [n["state"] for n in status["nodes"]] == ["running", "running"]
    assert all(n["ssh"] and n["leader_pid"] and n["memory_bytes"] > 0 for n in status["nodes"])
    n1 = status["nodes"][0]

    inv = yaml.safe_load(inventory.read_text())
    assert inv["all"]["hosts"][n1["name"]]["ansible_host"] == n1["address"]

    # A TCP listener on node 1, a client on node 2: traffic crosses the lab bridge.
    server = subprocess.Popen(
        [sys.executable, "-m", "shardstack", "lab", "exec", "--name", name, "1", "--", "python3", "-c",
         "import socket; s = socket.create_server(('0.0.0.0', 7001)); c, _ = s.accept(); c.sendall(b'pong ' + "
         "socket.gethostname().encode()); c.close()"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = n1["address"]
        client = "import socket, time\nfor _ in range(50):\n  try:\n"
        client += f"    print(socket.create_connection(('{addr}', 7001), timeout=2).recv(64).decode()); break\n"
        client += "  except ConnectionRefusedError: time.sleep(0.1)\n"
        out = node_exec(name, "2", f"python3 -c \"{client}\"")
        assert out.stdout.strip() == f"pong {n1['name']}", out.stderr
    finally:
        server.wait(timeout=30)

    # Debian packages come through the host's apt proxy; nothing else is reachable from a node.
    out = node_exec(name, "2", "apt-get update -q && apt-get install -y -q --no-install-recommends netcat-openbsd "
                                "&& dpkg-query -W -f='${Status}' netcat-openbsd", timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.endswith("install ok installed")
    out = node_exec(name, "2", "python3 -c \"import socket; socket.create_connection(('192.0.2.1', 80), timeout=2)\"")
    assert out.returncode != 0 and "Network is unreachable" in out.stderr

    # Each node has its own identity.
    ids = {node_exec(name, n, "cat /etc/machine-id").stdout for n in ("1", "2")}
    assert len(ids) == 2


def test_two_labs_coexist_without_colliding(tmp_path: Path) -> None:
    a, b = unique_name(), unique_name()
    try:
        cli("lab", "up", "--name", a, "--nodes", "1", "--write-inventory", str(tmp_path / "a.yml"))
        cli("lab", "up", "--name", b, "--nodes", "1", "--write-inventory", str(tmp_path / "b.yml"))
        sa, sb = (json.loads(cli("lab", "status", "--name", n, "--json").stdout) for n in (a, b))
        assert sa["subnet"] != sb["subnet"] and sa["bridge"] != sb["bridge"]
        assert sa["nodes"][0]["state"] == sb["nodes"][0]["state"] == "running"
    finally:
        cli("lab", "down", "--name", a, check=False)
        cli("lab", "down", "--name", b, check=False)
    assert lab.leftovers(a) == [] and lab.leftovers(b) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["lab", "up", "--name", "Bad_Name"], "invalid lab name"),
        (["lab", "up", "--name", "toolongname1"], "invalid lab name"),
        (["lab", "up", "--name", "zz", "--nodes", "0"], "--nodes must be between 1 and"),
        (["lab", "up", "--name", "zz", "--nodes", "500"], "--nodes must be between 1 and"),
        (["lab", "down", "--name", "nosuch"], "does not exist"),
        (["lab", "status", "--name", "nosuch"], "does not exist"),
        (["lab", "exec", "--name", "nosuch", "1", "--", "true"], "does not exist"),
        (["lab", "up", "--name", "zz", "--release", "sid"], "argument --release: invalid choice: 'sid'"),
    ],
)
def test_bad_input_gets_a_clear_error(args: list[str], message: str) -> None:
    proc = cli(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_name_in_use_is_refused(two_nodes) -> None:
    name, _ = two_nodes
    proc = cli("lab", "up", "--name", name, "--nodes", "1", check=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert json.loads(cli("lab", "status", "--name", name, "--json").stdout)["nodes"][0]["state"] == "running"


def test_down_is_quick_and_clean(tmp_path: Path) -> None:
    name = unique_name()
    cli("lab", "up", "--name", name, "--nodes", "2", "--write-inventory", str(tmp_path / "h.yml"))
    pids = [n.nspawn_pid for n in lab.st.LabState.load(name).nodes]
    started = time.monotonic()
    cli("lab", "down", "--name", name)
    assert time.monotonic() - started < 30
    assert lab.leftovers(name) == []
    # Gone, or a zombie waiting for the host's init to reap it: either way no longer running.
    assert not any(Path(f"/proc/{p}").exists() and not is_zombie(p) for p in pids)


def test_images_are_per_release_and_bookworms_key_is_unchanged() -> None:
    bookworm, trixie = image.image_key("bookworm"), image.image_key("trixie")
    assert bookworm.startswith("debian-bookworm-") and trixie.startswith("debian-trixie-")
    # The recipe text of bookworm is what it was before releases existed: its cached image stays valid.
    recipe = "\n".join([image.RECIPE_VERSION, "bookworm", image.MIRROR, *image.PACKAGES, *image.MASKED_UNITS,
                        f"deb {image.MIRROR} bookworm main\n"])
    assert bookworm == f"debian-bookworm-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    assert image.sources("trixie")[0] == "etc/apt/sources.list.d/debian.sources"  # deb822, as trixie installs
    with pytest.raises(ShardstackError, match="unknown lab release 'sid'"):
        image.image_key("sid")


def test_trixie_node_runs_systemd_257_on_the_unified_hierarchy(tmp_path: Path) -> None:
    """Debian 13's systemd under the host's nspawn 252 on a hybrid host: booted with cgroup2 at /sys/fs/cgroup."""
    name = unique_name()
    cli("lab", "up", "--name", name, "--nodes", "1", "--release", "trixie",
        "--write-inventory", str(tmp_path / "h.yml"))
    try:
        info = json.loads(cli("lab", "status", "--name", name, "--json").stdout)
        assert info["release"] == "trixie" and info["nodes"][0]["state"] == "running"
        out = node_exec(name, "1", "cut -d. -f1 /etc/debian_version; systemctl --version | head -1 | cut -d' ' -f2; "
                                   "stat -fc %T /sys/fs/cgroup; python3 -c 'import sys; print(sys.version_info[:2])'; "
                                   "grep -h Suites /etc/apt/sources.list.d/debian.sources; "
                                   "systemctl --failed --no-legend")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n") == ["13", "257", "cgroup2fs", "(3, 13)", "Suites: trixie", ""]
    finally:
        cli("lab", "down", "--name", name, check=False)
    assert lab.leftovers(name) == []


def test_a_lab_node_gets_its_share_of_the_host_cores_as_omp_threads() -> None:
    assert [omp_threads(n, host_cores=2) for n in (1, 2, 3)] == [2, 1, 1]
    assert [omp_threads(n, host_cores=16) for n in (1, 3, 4)] == [16, 5, 4]


def test_inventory_layout_spreads_cluster_roles() -> None:
    three = group_layout(["a", "b", "c"])
    assert three["train_nodes"] == ["a", "b"] and three["inference_nodes"] == ["b", "c"]
    assert three["loadbalancer"] == three["storage_server"] == three["monitoring_server"] == ["a"]
    assert three["slurm_controller"] == ["a"]  # slurmctld + slurmdbd on the head node, beside monitoring
    one = group_layout(["a"])
    assert all(members == ["a"] for members in one.values())
