"""Fault injection for the checkpoint tests: SIGKILL a rank from inside DCP's file writer, mid-save."""

from __future__ import annotations

import os
import signal


def die_while_writing(step: int) -> None:
    """After this process has written the first item of one of its shards for `step`'s save, SIGKILL it.

    The shard is left partly written, .metadata and manifest.json never appear, and the step directory keeps its
    `.tmp-` name: exactly what a node crash in the middle of a save leaves behind.
    """
    import torch.distributed.checkpoint.filesystem as fs

    original = fs._write_item

    def write_then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        stream = args[1] if len(args) > 1 else kwargs.get("stream")
        if f"step_{step:08d}.tmp-" in str(getattr(stream, "name", "")):
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    fs._write_item = write_then_die
