"""`shardstack checkpoint ls|verify DIR` and `shardstack export --checkpoint DIR --out DIR` (docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardstack.errors import ShardstackError


def register(sub: argparse._SubParsersAction) -> None:
    ck = sub.add_parser("checkpoint", help="list and verify training checkpoints")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    ls = ck_sub.add_parser("ls", help="list the checkpoints under DIR (sizes checked; use verify for checksums)")
    ls.add_argument("dir", type=Path, help="checkpoint root (checkpoint.dir of the job)")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    ls.set_defaults(func=_ls)
    verify = ck_sub.add_parser("verify", help="check sizes and sha256 of every file; exit 1 if any is invalid")
    verify.add_argument("dir", type=Path, help="checkpoint root, or one step_XXXXXXXX directory")
    verify.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    verify.set_defaults(func=_verify)

    ex = sub.add_parser("export", help="consolidate a checkpoint into safetensors: for serving, or for transformers")
    ex.add_argument("--checkpoint", type=Path, required=True,
                    help="a step_XXXXXXXX directory, or a checkpoint root (its newest valid checkpoint)")
    ex.add_argument("--out", type=Path, required=True, help="output directory")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the exported weights (default float32)")
    ex.add_argument("--format", dest="fmt", default="shardstack", choices=["shardstack", "hf"],
                    help="shardstack: what `shardstack serve` loads (default); hf: a Hugging Face directory that "
                         "transformers' from_pretrained loads (Llama)")
    ex.add_argument("--tokenizer", default=None, metavar="DIR|bytes",
                    help="the tokenizer to ship with the model (default: the one the job's data was prepared with)")
    ex.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint (sizes only)")
    ex.set_defaults(func=_export)


def _infos(root: Path, *, checksums: bool):
    from shardstack.train.checkpoint.layout import MANIFEST, is_step_dir, list_checkpoints, verify_checkpoint

    if not root.is_dir():
        raise ShardstackError(f"{root} is not a directory")
    if (root / MANIFEST).is_file() or is_step_dir(root):
        return [verify_checkpoint(root, checksums=checksums)]
    infos = [verify_checkpoint(path, checksums=checksums) for _, path in list_checkpoints(root)]
    if not infos:
        raise ShardstackError(f"no checkpoints (step_XXXXXXXX directories) under {root}")
    return infos


def _as_dict(info) -> dict:
    m = info.manifest or {}
    return {
        "step": info.step, "path": str(info.path), "valid": info.valid, "problem": info.problem,
        "checked": info.checked, "world_size": m.get("world_size"), "stage": m.get("stage"),
        "config_hash": m.get("config_hash"), "created": m.get("created"), "bytes": m.get("total_bytes"),
        "files": len(m.get("files", {})),
    }


def _print_table(infos) -> None:
    print(f"{'STEP':>9}  {'WORLD':>5}  {'STAGE':>5}  {'SIZE':>10}  {'CREATED':<25}  STATUS")
    for info in infos:
        d = _as_dict(info)
        size = f"{d['bytes'] / 2**20:.1f} MiB" if d["bytes"] is not None else "-"
        status = f"ok ({info.checked})" if info.valid else f"INVALID: {info.problem}"
        print(f"{d['step']:>9}  {d['world_size'] or '-':>5}  {d['stage'] if d['stage'] is not None else '-':>5}  "
              f"{size:>10}  {d['created'] or '-':<25}  {status}")


def _ls(args: argparse.Namespace) -> int:
    infos = _infos(args.dir, checksums=False)
    if args.json:
        print(json.dumps([_as_dict(i) for i in infos], indent=2))
    else:
        _print_table(infos)
    return 0


def _verify(args: argparse.Namespace) -> int:
    infos = _infos(args.dir, checksums=True)
    if args.json:
        print(json.dumps([_as_dict(i) for i in infos], indent=2))
    else:
        _print_table(infos)
    bad = [i for i in infos if not i.valid]
    if bad and not args.json:
        newest_valid = next((i for i in reversed(infos) if i.valid), None)
        fallback = f"step {newest_valid.step}" if newest_valid else "none (a resume starts from step 0)"
        print(f"{len(bad)} of {len(infos)} invalid; resume: auto would use {fallback}")
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    from shardstack.train.export import export_checkpoint
    from shardstack.train.memory.host import tune_allocator

    tune_allocator()
    result = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, verify=not args.no_verify, fmt=args.fmt,
                               tokenizer=args.tokenizer)
    print(
        f"exported step {result.step}: {result.tensors} tensors, {result.bytes_written / 2**20:.1f} MiB "
        f"({args.dtype}, format {args.fmt}) to {result.out} in {result.seconds:.1f}s; "
        f"peak host memory {result.peak_rss_bytes / 2**20:.0f} MiB, largest tensor "
        f"{result.largest_tensor_bytes / 2**20:.1f} MiB"
    )
    return 0
