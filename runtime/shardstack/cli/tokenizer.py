"""`shardstack tokenizer train INPUT --vocab-size N --out DIR`: byte-level BPE with Hugging Face `tokenizers`."""

from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = tok_sub.add_parser("train", help="learn byte-level BPE merges from text, locally")
    train.add_argument("input", nargs="?", default=None,
                       help="a text file or a directory of *.txt (default: the corpus shipped with shardstack)")
    train.add_argument("--vocab-size", type=int, required=True, help="entries, including the 256 bytes and EOS")
    train.add_argument("--out", required=True,
                       help="output directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json)")
    train.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from shardstack.model.tokenizer import EOS, train_bpe
    from shardstack.train.data import input_files

    started = time.monotonic()
    files = input_files(args.input)
    tok = train_bpe(files, args.vocab_size, args.out)
    if args.json:
        print(json.dumps({"out": str(args.out), "tokenizer": f"{args.out}/tokenizer.json", "files": len(files),
                          "vocab_size": tok.vocab_size, "eos": EOS, "eos_id": tok.eos_id, "sha256": tok.sha256,
                          "seconds": round(time.monotonic() - started, 3)}, indent=2))
        return 0
    print(f"trained byte-level BPE on {len(files)} file(s) in {time.monotonic() - started:.1f}s: vocabulary "
          f"{tok.vocab_size} (EOS {EOS} = {tok.eos_id}) → {args.out}/tokenizer.json (sha256 {tok.sha256[:12]})")
    return 0
