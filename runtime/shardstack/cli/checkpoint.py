"""`shardstack checkpoint ls|verify DIR` and `shardstack export --checkpoint DIR --out DIR` (docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from shardstack.errors import ShardstackError
from shardstack.signing import DEFAULT_KEY_FILE

_KEY_HELP = f"the cluster's signing key (default {DEFAULT_KEY_FILE})"
_UNSIGNED_HELP = ("do not check signatures (checkpoints of a job with checkpoint.require_signature: false); files "
                  "are still checked and nothing is unpickled")


def key_args(p: argparse.ArgumentParser, unsigned_help: str = _UNSIGNED_HELP) -> None:
    """--key-file and --allow-unsigned: every command that checks or makes a signature takes both."""
    p.add_argument("--key-file", type=Path, default=Path(DEFAULT_KEY_FILE), help=_KEY_HELP)
    p.add_argument("--allow-unsigned", action="store_true", help=unsigned_help)


def register(sub: argparse._SubParsersAction) -> None:
    ck = sub.add_parser("checkpoint", help="list and verify training checkpoints")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    ls = ck_sub.add_parser("ls", help="list the checkpoints under DIR (signature and sizes; verify adds sha256)")
    ls.add_argument("dir", type=Path, help="checkpoint root (checkpoint.dir of the job)")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    key_args(ls)
    ls.set_defaults(func=_ls)
    verify = ck_sub.add_parser("verify", help="check signature, sizes and sha256 of every file; exit 1 if any is "
                                              "invalid")
    verify.add_argument("dir", type=Path, help="checkpoint root, or one step_XXXXXXXX directory")
    verify.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    key_args(verify)
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
    ex.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    key_args(ex, _UNSIGNED_HELP + "; the export's manifest is written unsigned, which `serve` refuses without "
                                  "--allow-unsigned")
    ex.set_defaults(func=_export)


def load_key(args: argparse.Namespace):
    """The key --key-file names, or None with --allow-unsigned."""
    from shardstack.signing import load_signing_key

    if args.allow_unsigned:
        return None
    if not args.key_file.exists():
        raise ShardstackError(f"no signing key at {args.key_file}", hint="pass the cluster's key (a job's checkpoint."
                              "signing_key_file) with --key-file, or --allow-unsigned where nothing is signed")
    return load_signing_key(args.key_file)


def _infos(root: Path, *, key, checksums: bool) -> tuple[list, list[dict]]:
    """The checkpoints under a root (or the one step directory given), verified, and the root's quarantined ones."""
    from shardstack.train.checkpoint.layout import (
        MANIFEST,
        is_step_dir,
        list_checkpoints,
        list_quarantined,
        verify_checkpoint,
    )

    if not root.is_dir():
        raise ShardstackError(f"{root} is not a directory")
    if (root / MANIFEST).is_file() or is_step_dir(root):
        return [verify_checkpoint(root, key=key, checksums=checksums)], []
    infos = [verify_checkpoint(path, key=key, checksums=checksums) for _, path in list_checkpoints(root)]
    quarantined = [{"step": step, "reason": reason, "path": str(path)} for step, reason, path in list_quarantined(root)]
    if not infos and not quarantined:
        raise ShardstackError(f"no checkpoints (step_XXXXXXXX directories) under {root}")
    return infos, quarantined


def _as_dict(info) -> dict:
    m = info.manifest or {}
    return {
        "step": info.step, "path": str(info.path), "valid": info.valid,
        "problem": str(info.problem) if info.problem else None,
        "reason": info.problem.reason if info.problem else None, "checked": info.checked,
        "signature": "checked" if info.signed else "not checked", "world_size": m.get("world_size"),
        "stage": m.get("stage"), "config_hash": m.get("config_hash"), "job": m.get("job"), "run_id": m.get("run_id"),
        "created": m.get("created"),
        "bytes": m.get("total_bytes"), "files": len(m.get("files", {})),
    }


def _print_table(infos, quarantined: list[dict]) -> None:
    print(f"{'STEP':>9}  {'WORLD':>5}  {'STAGE':>5}  {'SIZE':>10}  {'CREATED':<25}  STATUS")
    for info in infos:
        d = _as_dict(info)
        size = f"{d['bytes'] / 2**20:.1f} MiB" if d["bytes"] is not None else "-"
        signature = "signed" if info.signed else "signature not checked"
        status = f"ok ({signature}, {info.checked})" if info.valid else f"INVALID: {info.problem}"
        print(f"{d['step']:>9}  {d['world_size'] or '-':>5}  {d['stage'] if d['stage'] is not None else '-':>5}  "
              f"{size:>10}  {d['created'] or '-':<25}  {status}")
    for q in quarantined:
        print(f"{q['step']:>9}  {'-':>5}  {'-':>5}  {'-':>10}  {'-':<25}  QUARANTINED ({q['reason']}): {q['path']}")


def _report(args: argparse.Namespace, *, checksums: bool) -> list:
    infos, quarantined = _infos(args.dir, key=load_key(args), checksums=checksums)
    if args.json:
        print(json.dumps({"checkpoints": [_as_dict(i) for i in infos], "quarantined": quarantined}, indent=2))
    else:
        _print_table(infos, quarantined)
    return infos


def _ls(args: argparse.Namespace) -> int:
    _report(args, checksums=False)
    return 0


def _verify(args: argparse.Namespace) -> int:
    infos = _report(args, checksums=True)
    bad = [i for i in infos if not i.valid]
    if bad and not args.json:
        newest_valid = next((i for i in reversed(infos) if i.valid), None)
        fallback = f"step {newest_valid.step}" if newest_valid else "none (a resume starts from step 0)"
        print(f"{len(bad)} of {len(infos)} invalid; resume: auto would use {fallback}")
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    from shardstack.train.export import export_checkpoint
    from shardstack.train.memory.host import tune_allocator

    key = load_key(args)
    tune_allocator()
    result = export_checkpoint(args.checkpoint, args.out, key=key, dtype=args.dtype, verify=not args.no_verify,
                               fmt=args.fmt, tokenizer=args.tokenizer)
    if args.json:
        print(json.dumps({**asdict(result), "out": str(result.out), "dtype": args.dtype, "format": args.fmt},
                         indent=2))
        return 0
    print(
        f"exported step {result.step}: {result.tensors} tensors, {result.bytes_written / 2**20:.1f} MiB "
        f"({args.dtype}, format {args.fmt}) to {result.out} in {result.seconds:.1f}s; "
        f"peak host memory {result.peak_rss_bytes / 2**20:.0f} MiB, largest tensor "
        f"{result.largest_tensor_bytes / 2**20:.1f} MiB"
    )
    return 0
