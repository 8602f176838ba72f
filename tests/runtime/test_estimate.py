"""The memory estimator's formulas, and its per-block activation count against the tensors autograd saves. The
measured side: test_distributed.py (the persistent part, per stage) and bench/memory.py (the peaks)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from shardstack.cli import main
from shardstack.cli.estimate import _fmt
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.model.llama import Llama, LlamaConfig
from shardstack.train.config import EngineConfig, config_from_dict
from shardstack.train.memory.estimate import block_widths, estimate, local_elements, zero_partition
from shardstack.train.parallelize import prepare_blocks


def test_fsdp_chunking_rule():
    t = torch.empty(15, 4, device="meta")
    assert [local_elements(t, 2, r) for r in range(2)] == [32, 28]
    assert [local_elements(torch.empty(3, device="meta"), 4, r) for r in range(4)] == [1, 1, 1, 0]


def test_zero_partition_is_greedy_largest_first():
    sizes = [torch.empty(n, device="meta") for n in (10, 7, 5, 4)]
    owned = zero_partition([sizes[:2], sizes[2:]], 2)
    assert [[p.numel() for p in r] for r in owned] == [[10, 4], [7, 5]]


@pytest.mark.parametrize("model,world,tp", [({"arch": "llama", "size": "tiny", "vocab_size": 259}, 7, 1),
                                             ({"arch": "llama", "size": "tiny", "vocab_size": 259}, 6, 2),
                                             ({"size": "tiny", "vocab_size": 257}, 5, 1)])
def test_the_reported_rank_holds_the_most_of_every_rank(model, world, tp):
    """`estimate` without a rank evaluates rank 0 alone at stages 0, 2 and 3 (every rank at stage 1): on uneven
    shards (rows not divisible by the world size) that is the maximum over every rank's own estimate."""
    cfg = config_from_dict({"model": model, "engine": {"tensor_parallel": tp},
                            "batch": {"global_batch": 2 * world // tp, "micro_batch": 2}})
    stages = [0, 1, 2, 3] if tp == 1 else [2, 3]
    for reported in estimate(cfg, world, stages=stages):
        every = [estimate(cfg, world, stages=[reported.stage], rank=r)[0] for r in range(world)]
        assert reported.peak == max(e.peak for e in every), reported.stage
        assert reported.total == max(e.total for e in every) and reported.init_peak == max(e.init_peak for e in every)
        assert len({e.total for e in every}) > 1 or reported.stage == 0  # the shards really are uneven


def test_gpt_1p3b_per_stage_formulas():
    cfg = config_from_dict({"model": {"size": "gpt-1.3b"}, "batch": {"global_batch": 64, "micro_batch": 1}})
    e = {r.stage: r for r in estimate(cfg, 8)}
    n = 24 * 12 * 2048**2 + 24 * 2 * 2048 + 2048 + 256 * 2048 + 2048 * 2048  # blocks + norms + embeddings (tied)
    assert e[0].params == 4 * n and e[0].grads == 4 * n
    assert e[0].optimizer == 8 * n + 4 * (24 * 6 + 3)
    assert e[3].total == e[2].total and abs(e[3].total - 16 * n / 8) < 0.001 * 16 * n
    assert e[1].total < e[0].total and abs(e[1].optimizer - 8 * n / 8) < 0.05 * 8 * n
    assert e[2].working_params > e[3].working_params > 0  # stage 2 keeps every block gathered
    assert e[0].activations == e[3].activations > 0


def test_offload_moves_state_off_the_device():
    e = {r.stage: r for r in estimate(config_from_dict({"engine": {"offload": "cpu"}}), 2)}
    on_device = {r.stage: r for r in estimate(config_from_dict({}), 2)}
    assert e[0].offloaded == 0 and e[0].peak == on_device[0].peak  # offload applies to FSDP stages only
    # The host keeps the state and runs the step: the device holds the working set and the activations.
    assert e[3].offloaded == e[3].total
    assert e[3].peak == e[3].working_params + e[3].accumulation_grads + e[3].activations
    assert e[3].peak == on_device[3].peak - on_device[3].params - on_device[3].optimizer


SMALL = {"model": {"size": "small"}, "batch": {"global_batch": 4, "micro_batch": 2}}  # 4 layers, d 128, seq 256
SHORT = {"model": {"size": "small", "seq_len": 64}, "batch": {"global_batch": 2, "micro_batch": 1}}  # few activations


def _one(cfg: dict, stage: int = 3, world: int = 2):
    return estimate(config_from_dict(cfg), world, stages=[stage])[0]


def test_activation_checkpointing_accounting():
    """none: every block keeps 16·t (t = b·s·d·e); a recomputed block keeps its input t and gets its other 15·t
    back when backward reaches it, after the blocks above it were freed. Backward adds one block's activation
    gradients (9·t at mlp_ratio 4) and the head its logits, log-softmax and gradient (b·s·V·(e + 8))."""
    t = 2 * 256 * 128 * 4
    head = 9 * t + 2 * 256 * 256 * (4 + 8)
    acts = {name: _one({**SMALL, "engine": engine}) for name, engine in [
        ("none", {}),
        ("full", {"activation_checkpointing": "full"}),
        ("every3", {"activation_checkpointing": "every_n", "activation_checkpointing_every": 3}),
        ("every2", {"activation_checkpointing": "every_n", "activation_checkpointing_every": 2})]}
    assert block_widths(GPTConfig()) == (16, 9)
    assert [acts[k].checkpointed_blocks for k in ("none", "full", "every3", "every2")] == [0, 4, 2, 2]
    assert acts["none"].activations == 4 * 16 * t + head
    assert acts["full"].activations == 4 * t + 15 * t + head  # at the last block's backward
    # every 3rd of 4 blocks (0 and 3): the last block is recomputed first, with all others kept
    assert acts["every3"].activations == (t + 16 * t + 16 * t + t) + 15 * t + head
    # blocks 0 and 2: block 3 (kept) is freed before block 2 is recomputed, so the start of backward is highest
    assert acts["every2"].activations == (t + 16 * t + t + 16 * t) + head
    # Only the activations move: state, working set and the optimizer's share are the same.
    for e in acts.values():
        assert (e.total, e.working_params, e.optimizer_temporaries) == (
            acts["none"].total, acts["none"].working_params, acts["none"].optimizer_temporaries)
    assert acts["none"].peak > acts["every3"].peak > acts["every2"].peak > acts["full"].peak


def _saved_bytes(engine: EngineConfig, model: GPT | Llama, b: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward (outside checkpointed regions,
    whose saves are replaced by recomputation)."""
    prepare_blocks(model.blocks, engine, torch.device("cpu"))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, model.config.vocab_size, (b, model.config.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


MODELS = {
    "gpt": lambda n_layer=4: GPT(GPTConfig(n_layer=n_layer, n_head=4, d_model=64, seq_len=32)),
    "llama-gqa": lambda n_layer=4: Llama(LlamaConfig(n_layer=n_layer, n_head=4, n_kv_head=2, d_model=64, ffn_dim=192,
                                                     seq_len=32)),
    "llama": lambda n_layer=4: Llama(LlamaConfig(n_layer=n_layer, n_head=4, n_kv_head=4, d_model=64, ffn_dim=160,
                                                 seq_len=32)),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_block_widths_are_what_autograd_saves(arch):
    """Per block, the estimator's count of d-wide tensors is what autograd keeps: the difference between 4 and 2
    blocks. What the formula leaves out: the norms' statistics and the attention's log-sum-exp (2 + n_head floats
    per token and block, ≤ 2% of a block here)."""
    torch.manual_seed(0)
    b = 2
    two_blocks = _saved_bytes(EngineConfig(), MODELS[arch](2), b)
    c = MODELS[arch]().config
    per_block = (_saved_bytes(EngineConfig(), MODELS[arch](4), b) - two_blocks) / 2
    assert per_block / (b * c.seq_len * c.d_model * 4) == pytest.approx(block_widths(c)[0], rel=0.02)


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize(("mode", "every", "recomputed"), [("full", None, 4), ("every_n", 2, 2), ("every_n", 3, 2)])
def test_checkpointing_drops_what_the_estimator_says(arch, mode, every, recomputed):
    """Autograd really saves less, and by what the estimator counts per block: a recomputed block no longer keeps
    its saved·b·s·d·e; it keeps its input (b·s·d·e), which checkpoint saves for the recompute."""
    torch.manual_seed(0)
    b = 2
    none = _saved_bytes(EngineConfig(), MODELS[arch](), b)
    ac = _saved_bytes(EngineConfig(activation_checkpointing=mode, activation_checkpointing_every=every),
                      MODELS[arch](), b)
    c = MODELS[arch]().config
    token = b * c.seq_len * c.d_model * 4
    expected_drop = recomputed * (block_widths(c)[0] - 1) * token
    assert none - ac == pytest.approx(expected_drop, rel=0.02), (none, ac, expected_drop)


def test_compile_changes_no_figure():
    assert _one({**SMALL, "engine": {"compile": True}}) == _one(SMALL)


def test_optimizer_temporaries_by_kernel():
    """foreach: sqrt(exp_avg_sq) for the largest param group (on this rank); for_loop: two temporaries of the
    largest tensor; fused: none. Stage 0 holds every tensor: the decay group is all matrices."""
    d, layers, vocab, seq = 128, 4, 256, 256
    matrices = layers * 12 * d * d + vocab * d + seq * d  # blocks' Linear weights, tied embedding, positions
    temps = {impl: _one({**SMALL, "optimizer": {"impl": impl}}, stage=0).optimizer_temporaries
             for impl in ("foreach", "for_loop", "fused")}
    assert temps == {"foreach": 4 * matrices, "for_loop": 2 * 4 * 4 * d * d, "fused": 0}
    # auto resolves by device, as make_optimizer does: foreach on CPU, fused on CUDA (unless offloaded).
    assert _one({**SMALL, "engine": {"device": "cpu"}}).optimizer_impl == "foreach"
    assert _one({**SMALL, "engine": {"device": "cuda"}}).optimizer_impl == "fused"
    assert _one({**SMALL, "engine": {"device": "cuda", "offload": "cpu"}}).optimizer_impl == "foreach"


def test_peak_is_the_larger_transient():
    """Activations are freed before optimizer.step: the peak adds the larger of the two, not both. With full
    checkpointing and short sequences the foreach temporaries exceed the activations; fused has none."""
    ac = {"activation_checkpointing": "full", "device": "cpu"}
    foreach = _one({**SHORT, "engine": ac}, stage=0)
    fused = _one({**SHORT, "engine": ac, "optimizer": {"impl": "fused"}}, stage=0)
    assert foreach.optimizer_temporaries > foreach.activations
    assert foreach.peak == foreach.total + foreach.optimizer_temporaries
    assert fused.peak == fused.total + fused.activations
    # The first step builds AdamW's state inside optimizer.step: forward/backward ran without it.
    assert foreach.first_step_peak == foreach.peak
    assert fused.first_step_peak == fused.total < fused.peak
    none = _one({**SMALL, "engine": {"device": "cpu"}}, stage=0)
    assert none.first_step_peak == none.peak - none.optimizer  # activations dominate: no AdamW state then


def test_fsdp_gradients_build_up_in_backward():
    """FSDP2's sharded gradients do not exist at the start of backward (zero_grad freed them); with full
    checkpointing the highest point is the last block's backward, with all of them reduced."""
    none = _one({**SMALL, "engine": {"device": "cpu"}}, stage=3)
    start = none.params + none.optimizer + none.working_params + none.activations
    assert none.peak == start  # activations dominate
    full = _one({**SHORT, "engine": {"device": "cpu", "activation_checkpointing": "full"}}, stage=3)
    t = 1 * 64 * 128 * 4
    late = full.params + full.optimizer + full.grads + full.working_params + (16 + 9) * t
    assert full.peak == late > full.params + full.optimizer + full.working_params + full.activations


def test_init_peak():
    """The model is built on the meta device. DDP stages materialise all of it (4E), then DDP broadcasts it
    through a flattened bucket (≤ 250 MiB) and allocates its gradient buckets (4E: counted at once on CUDA,
    resident on CPU only once written). FSDP stages allocate their shards only, filled in chunks of ~1 Mi elements
    (4 MiB scratch) — or of one tensor, when it is smaller."""
    cpu = {r.stage: r for r in estimate(config_from_dict({**SMALL, "engine": {"device": "cpu"}}), 2)}
    cuda = {r.stage: r for r in estimate(config_from_dict({**SMALL, "engine": {"device": "cuda"}}), 2)}
    four_e = cpu[0].params
    assert cpu[0].init_peak == cpu[1].init_peak == 2 * four_e  # the broadcast bucket holds the whole (small) model
    assert cuda[0].init_peak == 2 * four_e  # max(bucket, gradient buckets): equal here
    largest = 4 * 128 * 4 * 128  # the MLP's matrices: smaller than one init chunk
    assert cpu[3].init_peak == cpu[2].init_peak == cpu[3].params + largest
    big = {r.stage: r for r in estimate(config_from_dict({"model": {"size": "gpt-1.3b"}, "engine": {"device": "cuda"}}),
                                        8)}
    assert big[0].init_peak == 2 * big[0].params  # gradient buckets (4E > 250 MiB) counted on CUDA
    assert big[3].init_peak == big[3].params + 4 * 2**20  # an eighth of the model and one chunk of scratch
    big_cpu = estimate(config_from_dict({"model": {"size": "gpt-1.3b"}, "engine": {"device": "cpu"}}), 8, stages=[0])
    assert big_cpu[0].init_peak == big_cpu[0].params + 250 * 2**20


def test_cli_json(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("model: {size: tiny}\n")
    assert main(["estimate", "--config", str(job), "--world-size", "4", "--json", "--stage", "3"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["stage"], r["world_size"]) for r in rows] == [(3, 4)]


def test_cli_table_shows_the_options(tmp_path, capsys):
    """The table's header names the checkpointing mode and AdamW's kernels; its activations, AdamW temporaries and
    peak columns are the estimator's for those options (a Llama here)."""
    for engine, impl, blocks in [("{}", "foreach", 0), ("{activation_checkpointing: full}", "fused", 4)]:
        job = tmp_path / "job.yaml"
        text = ("model: {arch: llama, size: small}\nbatch: {global_batch: 4, micro_batch: 2}\n"
                f"engine: {engine}\noptimizer: {{impl: {impl}}}\n")
        job.write_text(text)
        assert main(["estimate", "--config", str(job), "--world-size", "2", "--stage", "3"]) == 0
        header, _columns, row = capsys.readouterr().out.splitlines()
        mode = "full" if blocks else "none"
        assert f"activation checkpointing {mode} ({blocks} blocks recomputed), AdamW {impl}" in header
        values = [" ".join(v) for v in zip(*[iter(row.split()[1:])] * 2, strict=True)]  # "12.00 MiB" pairs
        e = estimate(config_from_dict(yaml.safe_load(text)), 2, stages=[3])[0]
        assert values[5:8] == [_fmt(e.activations), _fmt(e.optimizer_temporaries), _fmt(e.peak)]
    none = _one({"model": {"arch": "llama", "size": "small"}, "batch": {"global_batch": 4, "micro_batch": 2}})
    assert e.activations < none.activations / 2 and e.optimizer_temporaries == 0 < none.optimizer_temporaries
