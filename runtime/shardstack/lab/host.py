"""The host side of the lab: running tools, the root and tool checks, and probing a port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from shardstack.errors import ShardstackError

REQUIRED_TOOLS = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "apt-cacher-ng": "apt-cacher-ng",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "ssh-keygen": "openssh-client",
}


def sh(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise ShardstackError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def require_root() -> None:
    if os.geteuid() != 0:
        raise ShardstackError("the lab needs root (it creates network namespaces, bridges and mounts)",
                              hint="run it as root, e.g. sudo shardstack lab up")


def preflight() -> None:
    require_root()
    missing = [f"{tool} (apt package {pkg})" for tool, pkg in REQUIRED_TOOLS.items() if not shutil.which(tool)]
    if missing:
        pkgs = " ".join(REQUIRED_TOOLS[m.split()[0]] for m in missing)
        raise ShardstackError("missing tools: " + ", ".join(missing), hint=f"apt-get install -y {pkgs}")


def port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0
