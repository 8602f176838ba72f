"""The lab's node image: a debootstrapped Debian root (12 bookworm or 13 trixie) with systemd, sshd and python3-apt,
built once per release and cached.

The cache key is the suite and a hash of its recipe below, so changing a recipe builds a new image and never reuses
a stale one, and the images of both releases coexist.
Nodes boot from an overlay on top of it, so the image itself is never written to after it is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.lab.report import Reporter
from shardstack.lab.state import cache_dir

# Debian's releases the lab boots: suite -> version. The default stays the one every scenario was written for.
RELEASES = {"bookworm": "12", "trixie": "13"}
DEFAULT_RELEASE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "iproute2", "openssh-server", "python3-apt", "sudo",
    "ca-certificates", "procps",
)
# Timers and units that only add noise or load to a lab node (and a getty that nspawn has no tty for).
MASKED_UNITS = (
    "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer",
    "dpkg-db-backup.timer", "getty@tty1.service", "console-getty.service", "systemd-timesyncd.service",
)
# What a fresh debootstrap writes: `main` only. The roles add the components their packages need (contrib, non-free,
# non-free-firmware for the NVIDIA driver), so the lab tests that they do.
# Bookworm's installer writes the one-line format to sources.list; trixie's writes deb822 to debian.sources.
RECIPE_VERSION = "4"


def check_release(release: str) -> str:
    if release not in RELEASES:
        raise ShardstackError(f"unknown lab release {release!r}",
                              hint="one of: " + ", ".join(f"{s} (Debian {v})" for s, v in RELEASES.items()))
    return release


def sources(release: str) -> tuple[str, str]:
    """The apt sources file of a fresh install of `release`: its path in the root and its content."""
    if release == "bookworm":
        return "etc/apt/sources.list", f"deb {MIRROR} {release} main\n"
    return "etc/apt/sources.list.d/debian.sources", (
        f"Types: deb\nURIs: {MIRROR}\nSuites: {release}\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")


def image_key(release: str = DEFAULT_RELEASE) -> str:
    path, content = sources(check_release(release))
    # Bookworm's recipe text is unchanged from before releases existed, so its cached image stays valid.
    parts = [RECIPE_VERSION, release, MIRROR, *PACKAGES, *MASKED_UNITS, content]
    if release != "bookworm":
        parts.append(path)
    return f"debian-{release}-{hashlib.sha256(chr(10).join(parts).encode()).hexdigest()[:12]}"


def image_path(release: str = DEFAULT_RELEASE) -> Path:
    return cache_dir() / "images" / image_key(release)


def ensure_image(progress: Reporter, release: str = DEFAULT_RELEASE) -> Path:
    """Return the cached image of `release`, building it first if needed (one builder at a time, others wait)."""
    target = image_path(release)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            progress.done(f"node image cached at {target}")
            return target
        _build(target, release, progress)
    return target


def _build(target: Path, release: str, progress: Reporter) -> None:
    tmp = target.with_name(target.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    log = target.with_name(target.name + ".log")
    started = time.monotonic()
    cmd = ["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), release, str(tmp), MIRROR]
    try:
        with progress.step(f"building node image (debootstrap Debian {RELEASES[release]}, ~2 min, once)") as step, \
                open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if line.startswith(("I: ", "E: ", "W: ")):
                    step.update(line[3:].strip())
            if proc.wait() != 0:
                raise ShardstackError(f"debootstrap failed (exit {proc.returncode}); see {log}",
                                      hint="the host must reach Debian's package mirror")
            _configure(tmp, release)
        (tmp / ".complete").write_text(f"built in {time.monotonic() - started:.0f}s\n")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress.done(f"node image built in {time.monotonic() - started:.0f}s at {target}")


def _configure(root: Path, release: str) -> None:
    # Every node must get its own machine-id (systemd writes one at first boot when the file is empty).
    (root / "etc/machine-id").write_text("")
    with contextlib.suppress(FileNotFoundError):
        (root / "var/lib/dbus/machine-id").unlink()
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    path, content = sources(release)
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    (root / path).write_text(content)
    # Host keys are generated per node at creation; a shared key would make nodes indistinguishable to ssh.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    lists = root / "var/lib/apt/lists"
    for f in lists.glob("*"):
        if f.is_file():
            f.unlink()
    for f in (root / "var/cache/apt/archives").glob("*.deb"):
        f.unlink()
    # An old mtime makes Ansible's `cache_valid_time` refresh the (empty) package lists on first use.
    os.utime(lists, (0, 0))
