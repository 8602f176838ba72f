"""`shardstack wheelhouse`: build (or find cached) the offline, hash-locked wheelhouse of one accelerator class for
the nodes' Python."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardstack.accel import BY_NAME, accelerator_class, probe
from shardstack.build.resolver import DEFAULT_PYTHON, TARGET_PYTHONS, VENVS, accelerator, resolve, target_python
from shardstack.build.wheelhouse import build, dependencies
from shardstack.ops.runner import project_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wheelhouse", help="build the offline wheelhouse the nodes install shardstack from")
    p.add_argument("--accelerator", default="cpu", choices=[*BY_NAME, "auto"],
                   help="the torch build: cpu (default, the lab's), a CUDA class, or auto (this machine's hardware "
                        "and loaded driver)")
    p.add_argument("--venv", default="runtime", choices=list(VENVS),
                   help="runtime (default: shardstack[train,serve]) or vllm (the vLLM engine's venv, "
                        "inference_service_engine: vllm)")
    default_python = "{}.{}".format(*DEFAULT_PYTHON)
    p.add_argument("--python", default=default_python, metavar="X.Y",
                   help=f"the nodes' CPython: {' or '.join('{}.{}'.format(*v) for v in TARGET_PYTHONS)} "
                        f"(default {default_python}: Debian 12; Debian 13 has 3.13)")
    p.add_argument("--driver-branch", default=None, help="with auto: decide for this driver branch instead")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve only: print the files the lock would pin, download nothing")
    p.add_argument("--deps-only", action="store_true",
                   help="fetch (or find cached) the dependencies only, without the shardstack wheel, and print their "
                        "directory (wheels + deps.lock): for a venv that runs shardstack from a checkout")
    p.add_argument("--cache", type=Path, default=None, help="cache directory (default $SHARDSTACK_CACHE/wheelhouse)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr)

    if args.accelerator == "auto":
        facts = probe(torch_facts=False)
        choice = accelerator_class(facts.hardware(), args.driver_branch or facts.driver_version)
        say(f"wheelhouse: accelerator {choice.accel.name}: {choice.reason}")
        accel = choice.accel
    else:
        accel = accelerator(args.accelerator)
    python = target_python(args.python)
    if args.dry_run:
        pins = resolve(project_dir(), accel, VENVS[args.venv], python)
        if args.json:
            print(json.dumps({"venv": args.venv, "accelerator": accel.name, "python": args.python,
                              "torch": accel.torch_version,
                              "pins": [{"name": p.name, "version": p.version, "file": p.filename, "sha256": p.sha256}
                                       for p in pins]}, indent=2))
        else:
            for p in pins:
                print(f"{p.name}=={p.version}  {p.filename}  sha256:{p.sha256 or '(computed on download)'}")
        return 0
    if args.deps_only:
        deps = dependencies(project_dir(), args.cache, accel=accel, venv=VENVS[args.venv], python=python, log=say)
        print(json.dumps({"venv": args.venv, "accelerator": accel.name, "python": args.python, "deps": str(deps)},
                         indent=2)
              if args.json else deps)
        return 0
    wh = build(project_dir(), args.cache, accel=accel, venv=VENVS[args.venv], python=python, log=say)
    if args.json:
        print(json.dumps(wh.to_dict(), indent=2))
    else:
        state = "built" if wh.built else "cached"
        print(f"{wh.path}  ({wh.venv} venv, {wh.accelerator}, CPython {wh.python}, torch {wh.torch}, {state}, "
              f"{wh.files} wheels, {wh.bytes / 2**20:.0f} MiB, lock {wh.lock}, {wh.seconds:.1f}s)")
    return 0
