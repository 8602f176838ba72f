"""The GPT's cached (serving) path must reproduce the full causal forward exactly, for mixed-length batches; the
arch registry builds what it names."""

import pytest
import torch
from shardstack.model.decoder import arch_spec
from shardstack.model.gpt import GPT, GPTConfig
from shardstack.model.kvcache import KVCache
from shardstack.model.shapes import GPT_PRESETS as PRESETS
from shardstack.model.spec import ARCHS, ShardedModel, build_arch


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=32)).eval()


@torch.no_grad()
def test_cached_decode_matches_full_forward(model: GPT) -> None:
    idx = torch.randint(0, 256, (3, 10))
    full = model(idx)
    cache = KVCache(model.config, 4, 32, dtype=torch.float32, device="cpu")
    slots = [2, 0, 3]
    for b, slot in enumerate(slots):  # prefill each row alone into its own slot
        logits = model(idx[b : b + 1, :6], cache=cache, slots=torch.tensor([slot]), positions=torch.tensor([0]))
        torch.testing.assert_close(logits, full[b : b + 1, :6])
    for t in range(6, 10):  # then decode the batch one token at a time
        logits = model(idx[:, t : t + 1], cache=cache, slots=torch.tensor(slots), positions=torch.tensor([t] * 3))
        torch.testing.assert_close(logits[:, 0], full[:, t])


@torch.no_grad()
def test_rows_at_different_positions_share_one_step(model: GPT) -> None:
    idx = torch.randint(0, 256, (2, 10))
    full = model(idx)
    cache = KVCache(model.config, 2, 32, dtype=torch.float32, device="cpu")
    model(idx[0:1, :3], cache=cache, slots=torch.tensor([1]), positions=torch.tensor([0]))
    model(idx[1:2, :7], cache=cache, slots=torch.tensor([0]), positions=torch.tensor([0]))
    step = torch.stack([idx[0, 3:4], idx[1, 7:8]])
    logits = model(step, cache=cache, slots=torch.tensor([1, 0]), positions=torch.tensor([3, 7]))
    torch.testing.assert_close(logits[0, 0], full[0, 3])
    torch.testing.assert_close(logits[1, 0], full[1, 7])


def test_context_limits_are_enforced(model: GPT) -> None:
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_head=4)


def test_flops_per_token_follows_palm_formula(model: GPT) -> None:
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - c.seq_len * c.d_model  # tied head counted once, no pos emb
    assert model.flops_per_token() == 6 * n + 12 * c.n_layer * c.d_model * c.seq_len


def test_largest_preset_is_about_1_3b_parameters() -> None:
    with torch.device("meta"):
        m = GPT(GPTConfig(**PRESETS["gpt-1.3b"]))
    assert 1.2e9 < m.num_params() < 1.45e9


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_registered_arch_builds_and_its_tp_plan_names_projections(arch: str) -> None:
    spec = ARCHS[arch]
    with torch.device("meta"):
        built = build_arch(arch, spec.presets["tiny"])
    assert arch_spec(built) is spec and isinstance(built, ShardedModel)
    for path in spec.tp_plan or {}:
        assert isinstance(built.blocks[0].get_submodule(path), torch.nn.Linear)
