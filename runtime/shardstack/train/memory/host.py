"""Host memory of this process: its measured peak, and a glibc setting that keeps that peak near one tensor."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across
    fork + exec, so a small process started by a big one would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def tune_allocator() -> None:
    """Make glibc return each freed tensor buffer to the OS at once (the export and CPU training call it).

    glibc raises its mmap threshold every time a large mmapped block is freed, so after the first few tensors
    later ones come from the heap, which does not shrink: the process's peak then creeps up with the model's size
    instead of staying near the largest tensor. A fixed 1 MiB threshold keeps every tensor buffer mmapped.
    """
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, 1 << 20)
