"""Export: consolidated safetensors equal to the gathered full state dict, bounded host memory, and the loader."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from shardstack.cli import main as cli
from shardstack.errors import ShardstackError
from shardstack.model.artifact import load_model
from shardstack.signing import SigningKey
from shardstack.train.checkpoint.layout import list_checkpoints, verify_checkpoint
from shardstack.train.export import export_checkpoint

from .conftest import HERE, REPO, TINY, AppState, make_checkpointer, torchrun

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(tmp_path: Path, key_file: Path) -> tuple[Path, AppState]:
    app = AppState()
    ckpt = make_checkpointer(tmp_path / "ckpt", key_file, interval=3)
    for _ in range(3):
        app.train(1)
        ckpt.maybe_save(app.step, app)
    ckpt.finish(app.step, app)
    return tmp_path / "ckpt", app


@pytest.mark.distributed
def test_export_of_an_fsdp_async_checkpoint_equals_the_gathered_full_state_dict(
    tmp_path: Path, key_file: Path, key: SigningKey
) -> None:
    full = tmp_path / "full.pt"
    rc, out = torchrun(2, str(HERE / "fsdp_worker.py"), "--ckpt", str(tmp_path / "ckpt"), "--steps", "6",
                       "--interval", "3", "--async-save", "--dump-full", str(full), "--key-file", str(key_file))
    assert rc == 0, out
    assert "committed in the background" in out
    infos = [verify_checkpoint(p, key=key) for _, p in list_checkpoints(tmp_path / "ckpt")]
    assert [(i.step, i.valid, i.manifest["world_size"]) for i in infos] == [(3, True, 2), (6, True, 2)]
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", key=key)
    assert result.step == 6
    expected = torch.load(full, weights_only=True)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    assert set(exported) == set(expected) - {"lm_head.weight"}  # the tied head is stored once
    for name, tensor in expected.items():
        torch.testing.assert_close(exported["tok_emb.weight" if name == "lm_head.weight" else name], tensor,
                                   rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {"arch": "gpt", "model": TINY.to_dict(), "step": 6, "dtype": "float32", "tokenizer": "bytes",
                      "source_checkpoint": str(tmp_path / "ckpt" / "step_00000006")}


def test_load_model_reproduces_the_trained_model(saved: tuple[Path, AppState], tmp_path: Path, key: SigningKey) -> None:
    root, app = saved
    export_checkpoint(root / "step_00000003", tmp_path / "out", key=key)
    model, meta = load_model(tmp_path / "out", "cpu", torch.float32)
    assert meta["step"] == 3 and model.lm_head.weight is model.tok_emb.weight and not model.training
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), app.model.eval()(idx), rtol=0, atol=0)


def test_bf16_export_and_load(saved: tuple[Path, AppState], tmp_path: Path, key: SigningKey) -> None:
    root, app = saved
    result = export_checkpoint(root, tmp_path / "out", key=key, dtype="bfloat16")
    n = sum(p.numel() for p in app.model.parameters())  # parameters() lists the tied weight once
    assert result.bytes_written == 2 * n
    model, meta = load_model(tmp_path / "out", "cpu", torch.bfloat16)
    assert meta["dtype"] == "bfloat16" and model.tok_emb.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.tok_emb.weight, app.model.tok_emb.weight.to(torch.bfloat16), rtol=0, atol=0)


def test_export_refuses_a_damaged_checkpoint(saved: tuple[Path, AppState], tmp_path: Path, key: SigningKey) -> None:
    root, _ = saved
    shard = root / "step_00000003" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ShardstackError, match="size mismatch"):
        export_checkpoint(root / "step_00000003", tmp_path / "out", key=key)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    from shardstack.signing import load_signing_key
    from shardstack.train.export import export_checkpoint
    from shardstack.train.memory.host import tune_allocator
    tune_allocator()  # as `shardstack export` does
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS: the baseline after imports
    before = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
    r = export_checkpoint(sys.argv[1], sys.argv[2], key=load_signing_key(sys.argv[3]))
    print(json.dumps({"before": before, "peak": r.peak_rss_bytes, "largest": r.largest_tensor_bytes,
                      "written": r.bytes_written}))
""")

SAVE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from shardstack.train.checkpoint.checkpointer import Checkpointer
    from shardstack.train.config import CheckpointConfig
    from shardstack.model.gpt import GPT, GPTConfig
    config = GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=64)
    torch.manual_seed(0)
    model = GPT(config)
    class Weights:
        def state_dict(self): return {"model": model.state_dict()}
        def load_state_dict(self, sd): raise AssertionError("not loaded here")
    cfg = CheckpointConfig(dir=sys.argv[1], interval=1, keep=1, resume="never", async_save=False,
                           signing_key_file=sys.argv[2])
    Checkpointer(cfg, config_hash="peak", job="peak", job_config={"model": config.to_dict()}).save(1, Weights())
""")


def test_export_peak_host_memory_is_bounded_by_the_largest_tensor(tmp_path: Path, key_file: Path) -> None:
    """A ~97 MiB model with 4 MiB tensors: the export must stay within 2 × largest + a constant, far below it."""
    subprocess.run([sys.executable, "-W", "ignore", "-c", SAVE_SCRIPT, str(tmp_path / "ckpt"), str(key_file)],
                   check=True, cwd=REPO, timeout=120)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PEAK_SCRIPT, str(tmp_path / "ckpt"),
                           str(tmp_path / "out"), str(key_file)], check=True, cwd=REPO, timeout=120,
                          capture_output=True, text=True)
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    growth, largest, model = m["peak"] - m["before"], m["largest"], m["written"]
    mib = 2**20
    print(f"\nexport peak host memory: +{growth / mib:.1f} MiB over the process baseline for a {model / mib:.1f} MiB "
          f"model whose largest tensor is {largest / mib:.1f} MiB (process peak {m['peak'] / mib:.0f} MiB)")
    assert largest == 4 * mib and model > 90 * mib
    assert growth <= 2 * largest + 24 * mib  # the tensor, the chunk DCP reads into it, and the library's own state
    assert growth < model / 3


def test_cli_ls_verify_and_export(saved: tuple[Path, AppState], tmp_path: Path, key_file: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    k = ["--key-file", str(key_file)]
    assert cli(["checkpoint", "ls", str(root), *k]) == 0
    assert "ok (signed, sizes)" in capsys.readouterr().out
    assert cli(["checkpoint", "verify", str(root), *k]) == 0
    assert "ok (signed, sha256)" in capsys.readouterr().out
    assert cli(["export", "--checkpoint", str(root), "--out", str(tmp_path / "out"), *k]) == 0
    assert "exported step 3" in capsys.readouterr().out
    (root / "step_00000003" / ".metadata").write_bytes(b"garbage")
    assert cli(["checkpoint", "verify", str(root), *k]) == 1
    out = capsys.readouterr().out
    assert "INVALID: size mismatch for .metadata" in out and "resume: auto would use none" in out
    assert cli(["checkpoint", "ls", "--json", str(root), *k]) == 0
    [entry] = json.loads(capsys.readouterr().out)["checkpoints"]
    assert entry["step"] == 3 and entry["valid"] is False and entry["reason"] == "size-mismatch"
    assert entry["world_size"] == 1 and entry["signature"] == "checked"
    assert cli(["export", "--checkpoint", str(root), "--out", str(tmp_path / "o2"), *k]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err


def test_cli_without_a_key_says_where_it_looked_and_how_to_proceed(
    saved: tuple[Path, AppState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    missing = tmp_path / "nowhere" / "checkpoint.key"
    for argv in (["checkpoint", "ls", str(root)], ["checkpoint", "verify", str(root)],
                 ["export", "--checkpoint", str(root), "--out", str(tmp_path / "out")]):
        assert cli([*argv, "--key-file", str(missing)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"shardstack: error: no signing key at {missing}\n") and "--allow-unsigned" in err
        assert "Traceback" not in err
    # --allow-unsigned checks everything but the signature, and says so.
    assert cli(["checkpoint", "verify", str(root), "--allow-unsigned"]) == 0
    assert "ok (signature not checked, sha256)" in capsys.readouterr().out
