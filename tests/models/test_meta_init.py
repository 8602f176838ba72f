"""Meta-device construction: no rank materialises the whole model, and the weights do not depend on how the model is
sharded (the same first loss at world sizes 1, 2 and 4, and at every stage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.init import CHUNK_ELEMENTS, init_parameters, to_empty
from shardstack.model.llama import Llama, LlamaConfig
from shardstack.model.spec import ModelConfig
from shardstack.train.build import build_on_meta

from .conftest import HERE, step_lines, torchrun, write_job

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for mode in ("meta", "eager"):
        d = tmp_path_factory.mktemp(mode)
        proc = torchrun(4, str(HERE / "workers" / "meta_init_worker.py"), str(d), mode)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[mode] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(4)]
    return out


@pytest.mark.slow
def test_no_rank_holds_the_full_model(memory) -> None:
    """4 ranks, ZeRO-3, a 282 M-parameter Llama (fp32 weights 4Ψ = 1.05 GiB). Peak RSS above the baseline (interpreter,
    torch, process group; measured in the same process just before the model is built)."""
    mib = 2**20
    full = 4 * memory["meta"][0]["params"]
    assert full >= 2**30
    for r, (meta, eager) in enumerate(zip(memory["meta"], memory["eager"], strict=True)):
        frac = {k: (meta[k] - meta["baseline"]) / full for k in ("init", "forward_backward", "step")}
        eager_init = (eager["init"] - eager["baseline"]) / full
        print(f"\nrank {r}: baseline {meta['baseline'] / mib:.0f} MiB; above it, in units of 4Ψ = {full / mib:.0f} "
              f"MiB: meta init {frac['init']:.3f}, + forward/backward {frac['forward_backward']:.3f}, + AdamW step "
              f"{frac['step']:.3f}; eager (whole model per rank) init {eager_init:.3f}")
        # Its quarter of the weights (0.25) and one init chunk of scratch; the old path held all of it, then the shards.
        assert frac["init"] < 0.30
        assert eager_init > 1.0
        # Its shards of weights and gradients (0.5) plus what FSDP gathers for the step: never a full model's worth.
        assert frac["forward_backward"] < 1.0
        # AdamW's state is 2Ψ·4 B / 4 ranks: with it the sharded state alone is 16Ψ/4 = 4Ψ bytes at 4 ranks — the
        # arithmetic of ZeRO-3 with fp32 AdamW, not a gathered model — plus the temporaries of the AdamW kernels the
        # run uses (foreach on CPU). The estimator's first-step peak for the same run bounds it.
        est = meta["estimated_first_step_peak"]
        print(f"rank {r}: first step {(meta['step'] - meta['baseline']) / mib:.0f} MiB, estimated {est / mib:.0f} MiB "
              f"(AdamW {meta['optimizer_impl']})")
        assert meta["step"] - meta["baseline"] < 1.1 * est
        assert est < 1.5 * full  # what the bound allows is still far from a gathered model plus its state (5Ψ·4 B)
    assert len({m["loss"] for m in memory["meta"]}) == 1


LLAMA = {"arch": "llama", "size": "tiny", "seq_len": 32}
GPT_TINY = {"size": "tiny", "seq_len": 32}


@pytest.fixture(scope="module")
def first_losses(tmp_path_factory, byte_data) -> dict[tuple[str, int, int], float]:
    """Step 1 of the trainer (through the CLI, under torchrun) for each (model, world size, stage)."""
    runs = [("llama", 1, 3), ("llama", 2, 3), ("llama", 4, 3), ("llama", 2, 2), ("llama", 2, 1), ("gpt", 1, 3),
            ("gpt", 2, 0)]
    out = {}
    for name, world, stage in runs:
        job = write_job(tmp_path_factory.mktemp("job") / "job.yaml", model=LLAMA if name == "llama" else GPT_TINY,
                        data={"path": str(byte_data)}, engine={"stage": stage},
                        batch={"global_batch": 4, "micro_batch": 1}, seed=7)
        proc = torchrun(world, "-m", "shardstack", "train", "run", "--config", str(job), "--max-steps", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name, world, stage] = step_lines(proc.stdout)[0]["loss"]
    return out


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_every_world_size_and_stage_starts_from_the_same_weights(first_losses, name) -> None:
    losses = {k: v for k, v in first_losses.items() if k[0] == name}
    print(f"\n{name} step-1 loss by (world size, stage): " + ", ".join(f"{k[1:]}: {v}" for k, v in losses.items()))
    first = next(iter(losses.values()))
    # Equal weights give equal losses up to the order of the cross-rank mean (the JSON line rounds to 1e-6).
    assert all(v == pytest.approx(first, rel=1e-6) for v in losses.values()), losses


def test_the_constructors_init_is_the_trainers() -> None:
    """Llama(c) under torch.manual_seed(s) equals a meta-built Llama filled after to_empty with seed s (ties kept),
    also for a tensor drawn in several chunks."""
    config = LlamaConfig(vocab_size=CHUNK_ELEMENTS // 64 + 3, d_model=64, n_layer=1, n_head=2, ffn_dim=128,
                         tie_embeddings=True)  # the embedding spans two chunks, the second one partial
    torch.manual_seed(11)
    eager = Llama(config)
    with torch.device("meta"):
        lazy = Llama(config)
    to_empty(lazy, "cpu")
    assert lazy.lm_head.weight is lazy.tok_emb.weight
    init_parameters(lazy, 11)
    for (name, a), b in zip(eager.named_parameters(), lazy.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert eager.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    torch.manual_seed(12)
    assert not torch.equal(Llama(config).tok_emb.weight, eager.tok_emb.weight)


def test_a_user_model_without_an_init_hook_is_refused_clearly(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "plain_model.py").write_text(
        "import torch\n"
        "class Plain(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])\n"
        "def make():\n"
        "    return Plain()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ShardstackError, match=r"Plain cannot be initialised on the meta device: it has no init_param"):
        build_on_meta(ModelConfig(factory="plain_model:make"), seed=0)
