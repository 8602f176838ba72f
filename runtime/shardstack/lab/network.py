"""The lab's network on the host: one bridge and /24 per lab, and the apt-cacher-ng that is the nodes' only way
out (to Debian's mirror)."""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import time
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.lab import state as st
from shardstack.lab.host import port_open, sh


@contextlib.contextmanager
def labs_lock():
    st.labs_dir().mkdir(parents=True, exist_ok=True)
    with open(st.labs_dir() / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def free_subnet_index() -> int:
    used = {st.LabState.load(n).subnet_index for n in st.list_labs()}
    routes = sh("ip", "-4", "-o", "addr", "show").stdout
    for k in range(256):
        if k not in used and f" {st.SUBNET_PREFIX}.{k}." not in routes:
            return k
    raise ShardstackError("no free lab subnet left", hint="take labs down with: shardstack lab down --name NAME")


def make_bridge(lab: st.LabState) -> None:
    sh("ip", "link", "add", lab.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{lab.bridge_ip}/24", "dev", lab.bridge)
    sh("ip", "link", "set", lab.bridge, "up")


def start_proxy(lab: st.LabState) -> None:
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
    while not port_open(lab.bridge_ip, 3142):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ShardstackError(f"apt-cacher-ng did not start; see {d / 'log'}")
        time.sleep(0.1)
