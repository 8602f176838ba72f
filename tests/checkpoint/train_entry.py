"""`shardstack train run …` under torchrun, with an optional injected crash.

SHARDSTACK_TEST_DIE_IN_SAVE=RANK:STEP makes that rank SIGKILL itself while writing STEP's checkpoint, but only in
the first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restarted job can show that it recovers.
"""

from __future__ import annotations

import os
import sys

from faults import die_while_writing
from shardstack.cli import main

if __name__ == "__main__":
    spec = os.environ.get("SHARDSTACK_TEST_DIE_IN_SAVE")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, step = (int(x) for x in spec.split(":"))
        if int(os.environ["RANK"]) == rank:
            die_while_writing(step)
    sys.exit(main(["train", "run", *sys.argv[1:]]))
