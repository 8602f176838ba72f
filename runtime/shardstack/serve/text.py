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
