"""The text side of serving: which tokenizer a model directory is served with, and turning a request's generated ids
into the text its client sees — decoded incrementally, stop sequences matched on that text.

A token can be part of a character (byte-level BPE splits rare characters into byte tokens, and the byte tokenizer
is all bytes), so ids go through `IncrementalDetokenizer`, which releases text only once its characters are
complete. Stop sequences are matched on the decoded text and the last `len(longest stop) − 1` characters are held
back, so no part of a stop string is ever emitted and every cut falls between characters. Streamed and non-streamed
requests run the same `TextStream`: the streamed deltas concatenate exactly to the non-streamed text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.model.tokenizer import TOKENIZER_JSON, ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer

GENERATION_CONFIG = "generation_config.json"
# Bytes per token assumed where the vocabulary gives no bound (a pipeline that can drop or shrink text: BERT-style
# whitespace splitting, accent stripping, an unknown token for whole words). Generous: WordPiece's [UNK] stands for
# at most 100 characters (≤ 400 bytes); no real token covers 1 KiB.
UNBOUNDED_BYTES_PER_TOKEN = 1024
# Parts of a tokenizer.json pipeline that never make text shorter, so a token covers at most its own string's bytes.
_KEEP_NORMALIZERS = {"Prepend"}  # and Replace of a string by one at least as long
_KEEP_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def model_tokenizer(model_dir: Path, meta: dict[str, Any], vocab_size: int) -> Tokenizer:
    """The tokenizer a model directory is served with: its tokenizer.json, else bytes (what a GPT export without a
    tokenizer was trained on). Refused when the model cannot embed the tokenizer's ids, or when the export names a
    tokenizer whose files are missing."""
    if (model_dir / TOKENIZER_JSON).is_file():
        tok: Tokenizer = HFTokenizer(model_dir)
    elif meta.get("tokenizer") not in (None, "bytes"):
        raise ShardstackError(f"{model_dir} was trained with tokenizer {meta['tokenizer']}, but has no "
                              f"{TOKENIZER_JSON}", hint="copy the tokenizer files of the job's data directory there")
    else:
        tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise ShardstackError(f"{model_dir}: the tokenizer has {tok.vocab_size} tokens, the model embeds only "
                              f"{vocab_size}", hint="serve the model with the tokenizer it was trained with")
    return tok


def max_input_bytes_per_token(tokenizer: Tokenizer) -> int:
    """The most bytes of UTF-8 prompt text one token can stand for, so a prompt of N bytes is at least
    ceil(N / this) tokens and can be refused by its size before it is encoded.

    Bytes: 1. A tokenizer.json whose pipeline cannot drop or shrink text (no normalizer but Prepend or a lengthening
    Replace, pre-tokenizers that split without removing, BPE without a fused unknown token, added tokens that strip
    no whitespace): its longest token string, counted in characters for byte-level BPE (one character per byte)
    and in UTF-8 bytes otherwise (SentencePiece's "▁" stands for one byte but is three). Anything else:
    UNBOUNDED_BYTES_PER_TOKEN."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    if not isinstance(tokenizer, HFTokenizer):
        return UNBOUNDED_BYTES_PER_TOKEN
    spec = json.loads(tokenizer.tok.to_str())
    model = spec.get("model") or {}
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    added = spec.get("added_tokens") or []
    keeps_text = (
        all(_lengthens(n) for n in _parts(spec.get("normalizer"), "normalizers"))
        and all(p.get("type") in _KEEP_PRE_TOKENIZERS and p.get("behavior") != "Removed" for p in pre)
        and model.get("type") == "BPE" and isinstance(model.get("vocab"), dict)
        and (model.get("unk_token") is None or model.get("byte_fallback") or not model.get("fuse_unk"))
        and not any(a.get("lstrip") or a.get("rstrip") for a in added)
    )
    if not keeps_text:
        return UNBOUNDED_BYTES_PER_TOKEN
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    longest = max((len(t) if byte_level else len(t.encode("utf-8")) for t in model["vocab"]), default=1)
    # An unknown token (unfused) stands for one character: at most 4 bytes.
    return max(longest, 4 if model.get("unk_token") else 1, *(len(a["content"].encode("utf-8")) for a in added))


def _parts(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A tokenizer.json normalizer or pre-tokenizer as the flat list of its parts (Sequence nests them)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [p for inner in component.get(key) or [] for p in _parts(inner, key)]
    return [component]


def _lengthens(normalizer: dict[str, Any]) -> bool:
    if normalizer.get("type") in _KEEP_NORMALIZERS:
        return True
    pattern = (normalizer.get("pattern") or {}).get("String")
    return (normalizer.get("type") == "Replace" and isinstance(pattern, str)
            and len(str(normalizer.get("content", "")).encode("utf-8")) >= len(pattern.encode("utf-8")))


def eos_ids(model_dir: Path, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end generation: the tokenizer's EOS and, for a Hugging Face directory, generation_config.json's
    eos_token_id (Llama 3 lists several: end of text, end of turn, …)."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    path = model_dir / GENERATION_CONFIG
    if path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise ShardstackError(f"{path} is unreadable: {exc}") from None
        ids |= {listed} if isinstance(listed, int) else {i for i in listed or [] if isinstance(i, int)}
    return frozenset(ids)


class TextStream:
    """One request's generated ids → released text, with its stop sequences.

    `push` takes one id and returns (text now safe to release, whether a stop sequence matched); `finish` releases
    what is held back when generation ends for another reason. A stop match cuts the text before the stop string;
    with several, the one that completes first wins (and, completing at the same character, the longer one).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # decoded, not yet released

    def push(self, token: int) -> tuple[str, bool]:
        self.pending += self.detok.push([token])
        return self._release(final=False)

    def finish(self) -> tuple[str, bool]:
        """Everything still held (an unfinished character decodes as U+FFFD), cut at a stop if one completes."""
        self.pending += self.detok.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> tuple[str, bool]:
        best: tuple[int, int] | None = None  # (end, start) of the earliest-completing match
        for s in self.stop:
            at = self.pending.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < best):
                best = (at + len(s), at)
        if best is not None:
            out, self.pending = self.pending[: best[1]], ""
            return out, True
        cut = len(self.pending) if final else max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False
