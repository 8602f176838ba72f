"""`shardstack pretrained`: build (once, then cached) the small pretrained Llama the demo fine-tunes."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrained", help="build the demo's pretrained Llama here (cached; `make pretrained`)")
    p.add_argument("--force", action="store_true", help="train it again even if the cache holds it")
    p.add_argument("--json", action="store_true", help="print its build record (loss curve, files) as JSON")
    p.set_defaults(func=_pretrained)


def _pretrained(args: argparse.Namespace) -> int:
    import json

    from shardstack.build import pretrained
    from shardstack.cli.output import EXIT_OK, console

    path = pretrained.build(force=args.force, echo=lambda m: console.print(m, highlight=False))
    rec = pretrained.record(path)
    if args.json:
        print(json.dumps({"path": str(path), **rec}, indent=2))
        return EXIT_OK
    curve = rec["loss_curve"]
    size = sum(f["bytes"] for f in rec["files"].values())
    console.print(f"{path}: {len(rec['files'])} files, {size / 1e6:.1f} MB; {rec['train_tokens']} training tokens; "
                  f"loss {curve[0][1]:.3f} (step {curve[0][0]}) → {curve[-1][1]:.3f} (step {curve[-1][0]}); "
                  f"built in {rec['seconds']} s", highlight=False)
    return EXIT_OK
