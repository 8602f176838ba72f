"""Bring a lab of systemd-nspawn nodes up and down (docs/lab.md).

Per lab: a host bridge with its own /24, an apt-cacher-ng bound to the bridge address (the only way out for
nodes), an ssh key. Per node: an overlay over the cached image, a network namespace wired to the bridge by a veth
pair (no default route, so nothing beyond the lab is reachable), a cgroup, and `systemd-nspawn --boot`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.lab import state as st
from shardstack.lab.host import port_open, preflight, require_root, sh
from shardstack.lab.image import DEFAULT_RELEASE, check_release, ensure_image
from shardstack.lab.inventory import write_inventory
from shardstack.lab.network import free_subnet_index, labs_lock, make_bridge, start_proxy
from shardstack.lab.node import (
    boot,
    cgroup_pids,
    is_zombie,
    kill,
    leader_pid,
    prepare_node,
    pss_bytes,
    rmdir_tree,
    system_state,
    wait_ready,
)
from shardstack.lab.report import Reporter, Silent


def up(name: str, nodes: int, inventory: Path, progress: Reporter | None = None,
       release: str = DEFAULT_RELEASE) -> st.LabState:
    progress = progress or Silent()
    st.validate_name(name)
    check_release(release)
    if not 1 <= nodes <= st.MAX_NODES:
        raise ShardstackError(f"--nodes must be between 1 and {st.MAX_NODES}, got {nodes}")
    preflight()
    if name in st.list_labs() or Path(f"/run/netns/{st.netns_name(name, 1)}").exists():
        raise ShardstackError(f"a lab named {name!r} already exists",
                              hint=f"take it down first (shardstack lab down --name {name}) or pick another name")
    image = ensure_image(progress, release)
    with labs_lock():
        k = free_subnet_index()
        d = st.labs_dir() / name
        d.mkdir(parents=True)
        lab = st.LabState(
            name=name, subnet_index=k, bridge=st.bridge_name(name), bridge_ip=f"{st.SUBNET_PREFIX}.{k}.1",
            dir=str(d), image=str(image), ssh_key=str(d / "id_ed25519"), inventory=str(inventory.resolve()),
            release=release,
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
            make_bridge(lab)
            start_proxy(lab)
            lab.save()
            for node in lab.nodes:
                prepare_node(lab, node)
        with progress.step(f"booting {nodes} node(s)") as step:
            for node in lab.nodes:
                node.nspawn_pid = boot(lab, node)
            lab.save()
            wait_ready(lab, step)
        write_inventory(lab, inventory)
    except BaseException:
        progress.warn(f"lab {name} failed to come up; tearing it down")
        down(name, Silent())
        raise
    progress.done(f"lab {name} up: {nodes} {release} node(s); inventory {inventory}")
    return lab


def down(name: str, progress: Reporter | None = None) -> None:
    progress = progress or Silent()
    st.validate_name(name)
    require_root()
    lab = st.LabState.load(name)
    with progress.step(f"taking lab {name} down ({len(lab.nodes)} node(s))"):
        _close_ssh_masters(lab)
        with ThreadPoolExecutor(max(1, len(lab.nodes))) as pool:
            list(pool.map(lambda n: kill(n.nspawn_pid, 15), lab.nodes))
        kill(lab.proxy_pid, 5)
        for node in lab.nodes:
            for cg in st.cgroup_paths(name, node.name):  # anything that escaped nspawn's own teardown
                for pid in cgroup_pids(cg):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for node in lab.nodes:
            if os.path.ismount(node.root) and sh("umount", node.root, check=False).returncode != 0:
                sh("umount", "-l", node.root, check=False)
            sh("ip", "link", "del", node.veth, check=False)  # can outlive the namespace
            sh("ip", "netns", "del", node.netns, check=False)
        sh("ip", "link", "del", lab.bridge, check=False)
        for cg_root in {p.parent for n in lab.nodes for p in st.cgroup_paths(name, n.name)}:
            rmdir_tree(cg_root)
        shutil.rmtree(lab.dir, ignore_errors=True)
    progress.done(f"lab {name} is down; nothing left behind")


def _close_ssh_masters(lab: st.LabState) -> None:
    """Ansible/molecule keep ssh ControlMaster processes for 60 s; close those that point at this lab's nodes."""
    cp_dir = Path.home() / ".ansible" / "cp"
    if not cp_dir.is_dir():
        return
    for node in lab.nodes:  # ansible's default ControlPath is ~/.ansible/cp/%C, a hash of host, port and user
        sh("ssh", "-o", f"ControlPath={cp_dir}/%C", "-O", "exit", "-p", "22", f"root@{node.ip}", check=False)


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
        alive = Path(f"/proc/{n.nspawn_pid}").exists() and not is_zombie(n.nspawn_pid)
        pid = leader_pid(n.nspawn_pid) if alive else None
        cgs = st.cgroup_paths(name, n.name)
        pss = pss_bytes(cgroup_pids(cgs[0])) if cgs else 0
        nodes.append({"name": n.name, "address": n.ip, "state": system_state(pid) if pid else "stopped",
                      "leader_pid": pid, "memory_bytes": pss, "ssh": port_open(n.ip, 22) if pid else False})
    return {"name": lab.name, "release": lab.release, "bridge": lab.bridge,
            "subnet": f"{lab.bridge_ip.rsplit('.', 1)[0]}.0/24",
            "apt_proxy": lab.proxy_url, "proxy_running": Path(f"/proc/{lab.proxy_pid}").exists(),
            "inventory": lab.inventory, "ssh_key": lab.ssh_key, "shared_dir": f"{lab.dir}/shared", "nodes": nodes}


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
