"""`python -m shardstack.accel [--smi] [--dcgm] [--driver-branch N]`: this node's facts and verdict as one JSON
document (validate.yml publishes it from every node)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from shardstack.accel.classes import AcceleratorError, accelerator_class
from shardstack.accel.device import gpu_problems
from shardstack.accel.facts import probe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardstack.accel",
                                description="this node's accelerator facts and verdict as one JSON document")
    p.add_argument("--smi", action="store_true", help="run nvidia-smi where it is installed")
    p.add_argument("--dcgm", action="store_true", help="run `dcgmi diag -r 1` on NVIDIA nodes where DCGM is")
    p.add_argument("--driver-branch", default=None, help="branch for the accelerator class (default: the loaded one)")
    args = p.parse_args(argv)
    facts = probe(smi=args.smi, dcgm=args.dcgm)
    out: dict[str, Any] = {"facts": facts.to_dict(), "has_nvidia": facts.has_nvidia,
                           "problems": [asdict(x) for x in gpu_problems(facts)]}
    try:
        out |= accelerator_class(facts.hardware(), args.driver_branch or facts.driver_version).to_dict()
    except AcceleratorError as exc:
        out |= {"accelerator": None, "reason": str(exc)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
