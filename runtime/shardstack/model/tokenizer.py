"""Tokenizers: the byte-level one (token = byte, vocabulary 256, nothing to train or ship) and byte-level BPE trained
locally with Hugging Face `tokenizers`, kept as the files transformers reads (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) — which also makes any Hugging Face model directory (e.g. Llama 3's) a tokenizer here.

`IncrementalDetokenizer` turns a growing list of ids into text deltas for streaming: a delta leaves only once its
characters are complete, so no broken UTF-8 is ever emitted and the deltas concatenate to the full decode.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from shardstack.errors import ShardstackError

BYTES = "bytes"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
EOS = "<|endoftext|>"  # what `tokenizer train` adds: the document separator, and generation's end
# The chat format `tokenizer train` writes into tokenizer_config.json (transformers' `chat_template`): each message
# as <|role|>, newline, its text, EOS; the assistant's turn opened at the end, so generation stops at its EOS.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token"
                 " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


class Tokenizer(Protocol):
    name: str  # "bytes", or the tokenizer.json's sha256 prefix
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    name = BYTES
    vocab_size = 256
    bos_id = eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_prompt = encode

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json (plus the special tokens that tokenizer_config.json names) from a directory."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.directory = Path(directory)
        path = self.directory / TOKENIZER_JSON
        if not path.is_file():
            raise ShardstackError(f"{self.directory} has no {TOKENIZER_JSON}",
                                  hint="train one with `shardstack tokenizer train`, or give 'bytes'")
        try:
            self.tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ShardstackError(f"{path} is not a tokenizer ({exc})") from None
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.name = f"tokenizer.json:{self.sha256[:12]}"
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(self.directory / TOKENIZER_CONFIG)
        self.bos_id = self._special_id(config.get("bos_token"))
        self.eos_id = self._special_id(config.get("eos_token"))

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):  # transformers' AddedToken serialisation
            token = token.get("content")
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """The text's ids, nothing added (a rendered chat prompt spells its own special tokens). Through the batch
        API, which encodes without holding the GIL (see encode_prompt)."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return encode([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model expects it: with what tokenizer.json's post-processor adds (Llama 3's
        <|begin_of_text|>; nothing for a tokenizer from `tokenizer train`, whose models never saw a BOS).

        Through the batch API: `Tokenizer.encode` holds the GIL for the whole encoding (a server's event loop stops
        while a long prompt is encoded on a worker thread), `encode_batch` releases it; `_fast` skips the offsets."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # _fast: tokenizers >= 0.21
        return encode([text], add_special_tokens=True)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"{path} is unreadable: {exc}") from None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """'bytes', or a directory holding tokenizer.json."""
    return ByteTokenizer() if str(spec) == BYTES else HFTokenizer(spec)


def copy_files(tokenizer: HFTokenizer, out: str | Path) -> None:
    """Put the tokenizer's files (those it has) into `out`: a data directory or a model export."""
    for name in FILES:
        if (tokenizer.directory / name).is_file():
            shutil.copyfile(tokenizer.directory / name, Path(out) / name)


def train_bpe(inputs: Sequence[Path], vocab_size: int, out: str | Path) -> HFTokenizer:
    """Byte-level BPE over `inputs` (text files) with `vocab_size` entries including the 256 byte symbols and EOS,
    saved to `out` with the config files transformers' AutoTokenizer reads."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ShardstackError(f"--vocab-size {vocab_size} is too small",
                              hint=f"byte-level BPE needs ≥ {len(alphabet) + 1}: the 256 bytes and {EOS}")
    tok = _Tokenizer(models.BPE())
    # No prefix space and no normaliser: decode(encode(text)) == text for any text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train([str(p) for p in inputs], trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_JSON))
    special = {"bos_token": EOS, "eos_token": EOS}
    (out / TOKENIZER_CONFIG).write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # transformers' default clean-up would break decode ∘ encode = id
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(special, indent=2) + "\n")
    return HFTokenizer(out)


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids.

    Decoding id by id breaks characters that span tokens (byte-level BPE splits rare characters into byte tokens).
    So it decodes a short window — the ids of the last delta plus the new ones — and emits the part beyond the last
    delta only when it does not end in U+FFFD, the mark of a character still incomplete. The window starts where
    complete text ended, so deltas concatenate to decode(all ids); tokenizers that drop a leading space at the start
    of a decode (SentencePiece) see the same context in both decodes of the window.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: the ids of the last emitted delta begin here
        self.read = 0  # ids up to here are emitted

    def push(self, ids: Iterable[int]) -> str:
        self.ids.extend(ids)
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        """What is held back, as it decodes (an unfinished character becomes U+FFFD), at the end of a stream."""
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


_worker_tokenizers: dict[str, Tokenizer] = {}


def encode_block(spec: str, path: str, start: int, end: int, eos: bool) -> tuple[bytes, int]:
    """Token ids of bytes [start, end) of a text file (plus EOS if `eos`), for `shardstack data prepare`'s worker
    processes: the ids as little-endian uint32 bytes, and the bytes read. Blocks are cut at line ends, so each holds
    whole characters; the tokenizer is loaded once per process."""
    import numpy as np

    tok = _worker_tokenizers.get(spec) or _worker_tokenizers.setdefault(spec, load_tokenizer(spec))
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if isinstance(tok, ByteTokenizer):
        ids = np.frombuffer(data, dtype=np.uint8).astype("<u4")
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ShardstackError(f"{path} is not UTF-8 text (byte {start + exc.start})") from None
        ids = np.asarray(tok.encode(text), dtype="<u4")
    if eos and tok.eos_id is not None:
        ids = np.append(ids, np.uint32(tok.eos_id))
    return ids.tobytes(), len(data)
