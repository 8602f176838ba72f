"""Prometheus text-format output for node_exporter's textfile collector, shared by every node-side metrics script
(the GPU health patrol, the log collector, the Slurm collector). shardstack_common/tasks/textfile_writer.yml puts
this file beside the script that imports it, so the script's directory on sys.path finds it. Standard library only:
the scripts run under the node's system python3."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def escape(value: str) -> str:
    """A label value as the exposition format quotes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> Path:
    """Replace `path` with `text` atomically: node_exporter (or the next run) sees the old file or the whole new one,
    never a torn one, also across a crash: the data is fsync'd before the rename and the rename before returning.
    A failed write leaves no temporary file behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path
