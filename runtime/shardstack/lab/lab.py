"""Bring a lab of systemd-nspawn nodes up and down (DESIGN.md §3).

Per lab: a host bridge with its own /24, an apt-cacher-ng bound to the bridge address (the only way out for
nodes), an ssh key. Per node: an overlay over the cached image, a network namespace wired to the bridge by a veth
pair (no default route, so nothing beyond the lab is reachable), a cgroup, and `systemd-nspawn --boot`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.lab import state as st
from shardstack.lab.image import ensure_image
from shardstack.lab.inventory import write_inventory
from shardstack.lab.progress import Progress

REQUIRED_TOOLS = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "apt-cacher-ng": "apt-cacher-ng",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "ssh-keygen": "openssh-client",
}
BOOT_TIMEOUT_S = 90
SHARED_MOUNT = "/mnt/lab-shared"  # the host directory every node sees: the lab's "shared storage" (bind backend)


def sh(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise ShardstackError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _require_root() -> None:
    if os.geteuid() != 0:
        raise ShardstackError("the lab needs root (it creates network namespaces, bridges and mounts)",
                              hint="run it as root, e.g. sudo shardstack lab up")


def preflight() -> None:
    _require_root()
    missing = [f"{tool} (apt package {pkg})" for tool, pkg in REQUIRED_TOOLS.items() if not shutil.which(tool)]
    if missing:
        pkgs = " ".join(REQUIRED_TOOLS[m.split()[0]] for m in missing)
        raise ShardstackError("missing tools: " + ", ".join(missing), hint=f"apt-get install -y {pkgs}")


@contextlib.contextmanager
def _labs_lock():
    st.labs_dir().mkdir(parents=True, exist_ok=True)
    with open(st.labs_dir() / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _free_subnet_index() -> int:
    used = {st.LabState.load(n).subnet_index for n in st.list_labs()}
    routes = sh("ip", "-4", "-o", "addr", "show").stdout
    for k in range(256):
        if k not in used and f" {st.SUBNET_PREFIX}.{k}." not in routes:
            return k
    raise ShardstackError("no free lab subnet left", hint="take labs down with: shardstack lab down --name NAME")


def up(name: str, nodes: int, inventory: Path, progress: Progress) -> st.LabState:
    st.validate_name(name)
    if not 1 <= nodes <= st.MAX_NODES:
        raise ShardstackError(f"--nodes must be between 1 and {st.MAX_NODES}, got {nodes}")
    preflight()
    if name in st.list_labs() or Path(f"/run/netns/{st.netns_name(name, 1)}").exists():
        raise ShardstackError(f"a lab named {name!r} already exists",
                              hint=f"take it down first (shardstack lab down --name {name}) or pick another name")
    image = ensure_image(progress)
    with _labs_lock():
        k = _free_subnet_index()
        d = st.labs_dir() / name
        d.mkdir(parents=True)
        lab = st.LabState(
            name=name, subnet_index=k, bridge=st.bridge_name(name), bridge_ip=f"{st.SUBNET_PREFIX}.{k}.1",
            dir=str(d), image=str(image), ssh_key=str(d / "id_ed25519"), inventory=str(inventory.resolve()),
        )
        lab.nodes = [
            st.NodeState(name=st.node_name(name, i), index=i, ip=f"{st.SUBNET_PREFIX}.{k}.{st.NODE_HOST_OFFSET + i}",
                         netns=st.netns_name(name, i), veth=st.veth_name(name, i), root=str(d / f"n{i}" / "root"))
            for i in range(1, nodes + 1)
        ]
        lab.save()  # saved first, so a failed `up` can always be taken down
    try:
        with progress.step(f"lab {name}: network {lab.bridge_ip}/24, apt proxy, {nodes} node roots"):
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"shardstack-lab-{name}", "-f", lab.ssh_key)
            _make_bridge(lab)
            _start_proxy(lab)
            lab.save()
            for node in lab.nodes:
                _prepare_node(lab, node)
        with progress.step(f"booting {nodes} node(s)") as step:
            for node in lab.nodes:
                node.nspawn_pid = _boot(lab, node)
            lab.save()
            _wait_ready(lab, step)
        write_inventory(lab, inventory)
    except BaseException:
        progress.warn(f"lab {name} failed to come up; tearing it down")
        down(name, Progress(quiet=True))
        raise
    progress.done(f"lab {name} up: {nodes} node(s); inventory {inventory}")
    return lab


def _make_bridge(lab: st.LabState) -> None:
    sh("ip", "link", "add", lab.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{lab.bridge_ip}/24", "dev", lab.bridge)
    sh("ip", "link", "set", lab.bridge, "up")


def _start_proxy(lab: st.LabState) -> None:
    d = Path(lab.dir) / "apt-cacher-ng"
    (d / "log").mkdir(parents=True)
    cache = st.cache_dir() / "apt-cacher-ng"
    cache.mkdir(parents=True, exist_ok=True)
    (d / "backends_debian").write_text("http://deb.debian.org/debian/\n")
    (d / "acng.conf").write_text(
        f"CacheDir: {cache}\nLogDir: {d / 'log'}\nSupportDir: /usr/lib/apt-cacher-ng\n"
        f"Port: 3142\nBindAddress: {lab.bridge_ip}\nPidFile: {d / 'pid'}\nSocketPath: {d / 'socket'}\n"
        "Remap-debrep: file:deb_mirror*.gz /debian ; file:backends_debian\n"
        "Remap-secdeb: security.debian.org deb.debian.org/debian-security /debian-security ; "
        "deb.debian.org/debian-security\n"
        "ExThreshold: 4\nPassThroughPattern: .*\n"
    )
    log = open(d / "log" / "stdout.log", "w")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(["apt-cacher-ng", "-c", str(d), "ForeGround=1"], stdout=log, stderr=log,
                            start_new_session=True)
    lab.proxy_pid = proc.pid
    deadline = time.monotonic() + 10
    while not _port_open(lab.bridge_ip, 3142):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ShardstackError(f"apt-cacher-ng did not start; see {d / 'log'}")
        time.sleep(0.1)


def _prepare_node(lab: st.LabState, node: st.NodeState) -> None:
    base = Path(node.root).parent
    for sub in ("upper", "work", "root"):
        (base / sub).mkdir(parents=True)
    sh("mount", "-t", "overlay", "overlay", "-o",
       f"lowerdir={lab.image},upperdir={base / 'upper'},workdir={base / 'work'}", node.root)
    root = Path(node.root)
    (root / "etc/hostname").write_text(node.name + "\n")
    hosts = ["127.0.0.1 localhost", f"{lab.bridge_ip} controller"] + [f"{n.ip} {n.name}" for n in lab.nodes]
    (root / "etc/hosts").write_text("\n".join(hosts) + "\n")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")  # no DNS: names come from /etc/hosts only
    (root / "etc/apt/apt.conf.d/01shardstack-proxy").write_text(f'Acquire::http::Proxy "{lab.proxy_url}";\n')
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(lab.ssh_key + ".pub").read_text())
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    sh("ssh-keygen", "-A", "-f", str(root))  # this node's own host keys
    (root / SHARED_MOUNT.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (Path(lab.dir) / "shared").mkdir(exist_ok=True)
    # Network: namespace, veth with eth0 inside, one address, no default route.
    sh("ip", "netns", "add", node.netns)
    sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
    sh("ip", "link", "set", node.veth, "master", lab.bridge, "up")
    for cmd in (("ip", "addr", "add", f"{node.ip}/24", "dev", "eth0"), ("ip", "link", "set", "eth0", "up"),
                ("ip", "link", "set", "lo", "up")):
        sh("ip", "netns", "exec", node.netns, *cmd)


def _boot(lab: st.LabState, node: st.NodeState) -> int:
    cgroups = st.cgroup_paths(lab.name, node.name)
    for cg in cgroups:
        cg.mkdir(parents=True, exist_ok=True)

    def enter_cgroup() -> None:  # runs in the child before exec: nspawn and the node live in their own cgroup
        for cg in cgroups:
            (cg / "cgroup.procs").write_text("0")

    cmd = [
        "systemd-nspawn", "--boot", "--register=no", "--keep-unit", f"--network-namespace-path=/run/netns/{node.netns}",
        "--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=read-only", "-q",
        f"--bind={lab.dir}/shared:{SHARED_MOUNT}", "-D", node.root, "-M", node.name,
    ]
    if Path("/dev/fuse").exists():
        cmd.append("--bind=/dev/fuse")
    log = open(Path(node.root).parent / "console.log", "w")  # noqa: SIM115 - handed to nspawn
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            preexec_fn=enter_cgroup)
    return proc.pid


def leader_pid(nspawn_pid: int) -> int | None:
    """The node's PID 1 (systemd), a descendant of the nspawn process."""
    todo = [nspawn_pid]
    while todo:
        pid = todo.pop()
        try:
            if pid != nspawn_pid and Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                return pid
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return None


def _port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0


def system_state(pid: int) -> str:
    proc = sh("nsenter", "-t", str(pid), "-m", "-p", "systemctl", "is-system-running", check=False)
    return proc.stdout.strip() or "unknown"


def _wait_ready(lab: st.LabState, step) -> None:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    pending = {n.name: n for n in lab.nodes}
    while pending:
        for name, node in list(pending.items()):
            if not Path(f"/proc/{node.nspawn_pid}").exists():
                log = (Path(node.root).parent / "console.log").read_text()[-2000:]
                raise ShardstackError(f"node {name} exited while booting:\n{log}")
            pid = leader_pid(node.nspawn_pid)
            if pid and system_state(pid) in ("running", "degraded") and _port_open(node.ip, 22):
                del pending[name]
        step.update(f"{len(lab.nodes) - len(pending)}/{len(lab.nodes)} ready")
        if pending and time.monotonic() > deadline:
            raise ShardstackError(f"nodes not ready after {BOOT_TIMEOUT_S}s: {', '.join(pending)}")
        if pending:
            time.sleep(0.2)


def _kill(pid: int, timeout: float) -> None:
    """SIGTERM (nspawn shuts the node down cleanly), then SIGKILL the whole session if it lingers."""
    if not pid:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def _cgroup_pids(cg: Path) -> list[int]:
    pids: list[int] = []
    for procs in cg.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def down(name: str, progress: Progress) -> None:
    st.validate_name(name)
    _require_root()
    lab = st.LabState.load(name)
    with progress.step(f"taking lab {name} down ({len(lab.nodes)} node(s))"):
        _close_ssh_masters(lab)
        with ThreadPoolExecutor(max(1, len(lab.nodes))) as pool:
            list(pool.map(lambda n: _kill(n.nspawn_pid, 15), lab.nodes))
        _kill(lab.proxy_pid, 5)
        for node in lab.nodes:
            for cg in st.cgroup_paths(name, node.name):  # anything that escaped nspawn's own teardown
                for pid in _cgroup_pids(cg):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for node in lab.nodes:
            if os.path.ismount(node.root) and sh("umount", node.root, check=False).returncode != 0:
                sh("umount", "-l", node.root, check=False)
            sh("ip", "link", "del", node.veth, check=False)  # can outlive the namespace
            sh("ip", "netns", "del", node.netns, check=False)
        sh("ip", "link", "del", lab.bridge, check=False)
        for cg_root in {p.parent for n in lab.nodes for p in st.cgroup_paths(name, n.name)}:
            _rmdir_tree(cg_root)
        shutil.rmtree(lab.dir, ignore_errors=True)
    progress.done(f"lab {name} is down; nothing left behind")


def _close_ssh_masters(lab: st.LabState) -> None:
    """Ansible/molecule keep ssh ControlMaster processes for 60 s; close those that point at this lab's nodes."""
    cp_dir = Path.home() / ".ansible" / "cp"
    if not cp_dir.is_dir():
        return
    for node in lab.nodes:  # ansible's default ControlPath is ~/.ansible/cp/%C, a hash of host, port and user
        sh("ssh", "-o", f"ControlPath={cp_dir}/%C", "-O", "exit", "-p", "22", f"root@{node.ip}", check=False)


def _rmdir_tree(cg: Path) -> None:
    if not cg.is_dir():
        return
    deadline = time.monotonic() + 5
    for sub in [*sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), cg]:
        while True:
            try:
                sub.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ShardstackError(f"cgroup {sub} still busy") from None
                time.sleep(0.1)


def leftovers(name: str) -> list[str]:
    """Everything of lab `name` still on the host (empty after a clean `down`); used by tests and `status`."""
    found: list[str] = []
    for line in sh("ip", "-o", "link", "show").stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link == st.bridge_name(name) or link.startswith(f"ssv-{name}-"):
            found.append(f"link {link}")
    found += [f"netns {n}" for n in sh("ip", "netns", "list").stdout.split() if n.startswith(f"ss-{name}-n")]
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {line.split()[1]}" for line in mounts.splitlines()
              if f"{st.labs_dir()}/{name}/" in line.split()[1] + "/"]
    for cg in (Path("/sys/fs/cgroup") / h / f"shardstack-{name}" for h in ("systemd", "unified", "")):
        if cg.is_dir():
            found.append(f"cgroup {cg}")
    if (st.labs_dir() / name).exists():
        found.append(f"dir {st.labs_dir() / name}")
    return found


def status(name: str) -> dict:
    lab = st.LabState.load(name)
    nodes = []
    for n in lab.nodes:
        alive = Path(f"/proc/{n.nspawn_pid}").exists() and not _is_zombie(n.nspawn_pid)
        pid = leader_pid(n.nspawn_pid) if alive else None
        cgs = st.cgroup_paths(name, n.name)
        pss = _pss_bytes(_cgroup_pids(cgs[0])) if cgs else 0
        nodes.append({"name": n.name, "address": n.ip, "state": system_state(pid) if pid else "stopped",
                      "leader_pid": pid, "memory_bytes": pss, "ssh": _port_open(n.ip, 22) if pid else False})
    return {"name": lab.name, "bridge": lab.bridge, "subnet": f"{lab.bridge_ip.rsplit('.', 1)[0]}.0/24",
            "apt_proxy": lab.proxy_url, "proxy_running": Path(f"/proc/{lab.proxy_pid}").exists(),
            "inventory": lab.inventory, "ssh_key": lab.ssh_key, "shared_dir": f"{lab.dir}/shared", "nodes": nodes}


def _pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


def exec_in(name: str, node_name: str, cmd: list[str], *, capture: bool = False) -> subprocess.CompletedProcess:
    lab = st.LabState.load(name)
    node = lab.node(node_name)
    pid = leader_pid(node.nspawn_pid)
    if not pid:
        raise ShardstackError(f"node {node.name} is not running")
    if not cmd:
        raise ShardstackError("no command given", hint=f"shardstack lab exec {node.name} -- systemctl status")
    env = ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
           f"TERM={os.environ.get('TERM', 'dumb')}", "LANG=C.UTF-8"]
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "--", *env, *cmd],
                          capture_output=capture, text=True)


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2)
