"""Tokenizers: byte-level BPE trained here, token shards from it, a job trained and exported with it, and the
incremental detokeniser the inference service will stream with."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.artifact import load_model
from shardstack.model.tokenizer import EOS, ByteTokenizer, HFTokenizer, IncrementalDetokenizer, train_bpe
from shardstack.train.data import CORPUS_DIR, input_files, prepare

from .conftest import shardstack, step_lines, write_job

VOCAB = 512
# Beyond the corpus: 2-, 3- and 4-byte UTF-8 characters the BPE never merged, so byte tokens split them.
UNSEEN = "naïve café — 東京 🙂🚀 Ελληνικά\n\tcode: x = f(y) ** 2\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    proc = shardstack("tokenizer", "train", "--vocab-size", str(VOCAB), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    return out


def test_encode_decode_is_the_identity(tokenizer) -> None:
    tok = HFTokenizer(tokenizer)
    assert tok.vocab_size == VOCAB and tok.eos_id == tok.tok.token_to_id(EOS)
    corpus = input_files(None)[0].read_text()
    ids = tok.encode(corpus)
    assert len(ids) < 0.6 * len(corpus.encode())  # merges were learnt
    assert tok.decode(ids) == corpus
    assert tok.decode(tok.encode(UNSEEN)) == UNSEEN


@pytest.mark.parametrize("which", ["bpe", "bytes"])
def test_incremental_detokenizer_on_random_cuts(tokenizer, which) -> None:
    tok = HFTokenizer(tokenizer) if which == "bpe" else ByteTokenizer()
    text = UNSEEN + input_files(None)[0].read_text()[:3000] + UNSEEN
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some tokens hold part of a character
    rng = random.Random(0)
    for _ in range(20):
        detok, deltas, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            n = rng.choice([1, 1, 1, 2, 3, 7])
            deltas.append(detok.push(ids[i: i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    emoji = tok.encode("🙂")
    assert len(emoji) > 1  # one character over several tokens
    cut = IncrementalDetokenizer(tok)  # a stream that ends inside it: held back, then flushed as it decodes
    assert cut.push(emoji[:-1]) == "" and cut.flush() == tok.decode(emoji[:-1]) == "\ufffd"


def test_prepare_with_the_tokenizer_records_it_and_picks_the_dtype(tokenizer, tmp_path) -> None:
    meta = prepare(CORPUS_DIR, tmp_path / "data", tokenizer=str(tokenizer), workers=2, block_bytes=100_000)
    tok = HFTokenizer(tokenizer)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB and meta["tokenizer_sha256"] == tok.sha256
    ids = np.fromfile(tmp_path / "data" / meta["shards"][0]["file"], dtype=np.uint16).tolist()
    assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == input_files(None)[0].read_text()
    assert (tmp_path / "data" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()

    big = tmp_path / "big"  # a vocabulary beyond uint16: ids are stored as uint32
    train_bpe(input_files(None), VOCAB, big)
    tok_big = HFTokenizer(big)
    tok_big.tok.add_tokens([f"<extra_{i}>" for i in range(66_000)])
    tok_big.tok.save(str(big / "tokenizer.json"))
    src = tmp_path / "big.txt"
    src.write_text("hello <extra_65999> world")
    meta = prepare(src, tmp_path / "data32", tokenizer=str(big))
    ids = np.fromfile(tmp_path / "data32" / meta["shards"][0]["file"], dtype=np.uint32)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65535 and ids.max() > 65535


def test_train_on_bpe_tokens_export_and_load(tokenizer, key_file, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = shardstack("data", "prepare", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "data"))
    assert proc.returncode == 0 and "vocabulary 512" in proc.stdout, proc.stderr
    job = write_job(tmp_path / "job.yaml", model={"arch": "llama", "size": "tiny", "vocab_size": VOCAB, "seq_len": 32},
                    data={"path": str(tmp_path / "data")}, batch={"global_batch": 4, "micro_batch": 2},
                    optimizer={"lr": 3e-3}, schedule={"warmup_steps": 0, "total_steps": 8},
                    checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 8, "signing_key_file": str(key_file)})
    proc = shardstack("train", "run", "--config", str(job))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [s["loss"] for s in step_lines(proc.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0]
    for fmt in ("shardstack", "hf"):
        proc = shardstack("export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / fmt),
                          "--format", fmt, "--key-file", str(key_file))
        assert proc.returncode == 0, proc.stderr
    model, meta = load_model(tmp_path / "shardstack")
    tok = HFTokenizer(tmp_path / "shardstack")
    assert meta["tokenizer"] == tok.name == HFTokenizer(tokenizer).name
    theirs_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Return the value of the attribute."
    assert theirs_tok(text)["input_ids"] == tok.encode(text) and theirs_tok.eos_token_id == tok.eos_id
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    idx = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert (theirs(idx).logits - model(idx)).abs().max().item() <= 1e-4


def test_data_vocabulary_must_fit_the_model(tokenizer, tmp_path) -> None:
    prepare(None, tmp_path / "data", tokenizer=str(tokenizer))
    job = write_job(tmp_path / "job.yaml", model={"arch": "llama", "size": "tiny", "seq_len": 32},
                    data={"path": str(tmp_path / "data")}, batch={"global_batch": 2, "micro_batch": 1})
    proc = shardstack("train", "run", "--config", str(job), "--max-steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data vocabulary (512) exceeds model.vocab_size (256)" in proc.stderr
    with pytest.raises(ShardstackError, match="too small"):
        train_bpe(input_files(None), 100, tmp_path / "small")
