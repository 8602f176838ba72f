"""One lab node: an overlay root over the cached image, its network namespace and veth, its cgroup, and
`systemd-nspawn --boot` (booting, waiting until ready, stopping)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.lab import state as st
from shardstack.lab.host import port_open, sh

BOOT_TIMEOUT_S = 90
SHARED_MOUNT = "/mnt/lab-shared"  # the host directory every node sees: the lab's "shared storage" (bind backend)
# Releases whose systemd gets the unified cgroup hierarchy (cgroup2 at /sys/fs/cgroup, the host's unified tree
# delegated) instead of nspawn's default on a hybrid host (v1 controllers + a v1 name=systemd tree). systemd 257
# (trixie) still boots hybrid, but upstream deprecated it in 256 and removed it in 258, and a real trixie host is
# cgroup2-only, so its nodes get what their systemd is made for. Bookworm's nodes keep nspawn's default, as before.
UNIFIED_CGROUP_RELEASES = frozenset({"trixie"})


def prepare_node(lab: st.LabState, node: st.NodeState) -> None:
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


def boot(lab: st.LabState, node: st.NodeState) -> int:
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
        # A node administers its own network namespace (the firewall role loads nftables rules), as a real host
        # does; nspawn grants CAP_NET_ADMIN only to containers whose network it creates itself.
        "--capability=CAP_NET_ADMIN",
    ]
    if Path("/dev/fuse").exists():
        cmd.append("--bind=/dev/fuse")
    env = dict(os.environ)
    if lab.release in UNIFIED_CGROUP_RELEASES:
        env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
    log = open(Path(node.root).parent / "console.log", "w")  # noqa: SIM115 - handed to nspawn
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            preexec_fn=enter_cgroup, env=env)
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


def system_state(pid: int) -> str:
    proc = sh("nsenter", "-t", str(pid), "-m", "-p", "systemctl", "is-system-running", check=False)
    return proc.stdout.strip() or "unknown"


def wait_ready(lab: st.LabState, step) -> None:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    pending = {n.name: n for n in lab.nodes}
    while pending:
        for name, node in list(pending.items()):
            if not Path(f"/proc/{node.nspawn_pid}").exists():
                log = (Path(node.root).parent / "console.log").read_text()[-2000:]
                raise ShardstackError(f"node {name} exited while booting:\n{log}")
            pid = leader_pid(node.nspawn_pid)
            if pid and system_state(pid) in ("running", "degraded") and port_open(node.ip, 22):
                del pending[name]
        step.update(f"{len(lab.nodes) - len(pending)}/{len(lab.nodes)} ready")
        if pending and time.monotonic() > deadline:
            raise ShardstackError(f"nodes not ready after {BOOT_TIMEOUT_S}s: {', '.join(pending)}")
        if pending:
            time.sleep(0.2)


def kill(pid: int, timeout: float) -> None:
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
        if not Path(f"/proc/{pid}").exists() or is_zombie(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def cgroup_pids(cg: Path) -> list[int]:
    pids: list[int] = []
    for procs in cg.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def rmdir_tree(cg: Path) -> None:
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


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total
