"""The Llama module against transformers' LlamaForCausalLM, its cached (serving) path, presets and the job config."""

from __future__ import annotations

import json

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model import hf
from shardstack.model.kvcache import KVCache
from shardstack.model.llama import Llama, LlamaConfig
from shardstack.model.shapes import LLAMA_PRESETS as PRESETS
from shardstack.model.spec import ModelConfig, arch_config, build_model
from shardstack.train.config import config_from_dict

from .conftest import shardstack, write_job


def ours_from(theirs, directory) -> Llama:
    """Our Llama with transformers' weights: the shape read from the config.json it saves, the tensors mapped by
    name only (no permutation)."""
    theirs.save_pretrained(directory)
    config = hf.read_config(directory).model
    model = Llama(config)
    state = {hf.from_hf(k): v for k, v in theirs.state_dict().items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]  # one parameter under both names
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize(("kv_heads", "tied", "rope_scaling"), [(2, False, True), (4, False, False), (2, True, False),
                                                                (4, True, True)])
@torch.no_grad()
def test_logits_equal_transformers(tmp_path, kv_heads, tied, rope_scaling) -> None:
    """Grouped-query (2 KV heads for 4) or not, tied or untied, with Llama 3.1 RoPE scaling or without; positions
    beyond the scaling's original context (16) so that the scaled frequencies matter."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16} if rope_scaling else None
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(HFConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=scaling, tie_word_embeddings=tied)).eval()
    ours = ours_from(theirs, tmp_path)
    assert ours.config.n_kv_head == kv_heads and (ours.lm_head.weight is ours.tok_emb.weight) == tied
    idx = torch.randint(0, 300, (3, 48))
    diff = (theirs(idx).logits - ours(idx)).abs().max().item()
    print(f"\nkv_heads {kv_heads}, tied {tied}, rope_scaling {rope_scaling}: max |Δlogits| = {diff:.2e}")
    assert diff <= 1e-4


@torch.no_grad()
def test_cached_decode_with_grouped_query_attention_matches_the_full_forward() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**PRESETS["tiny"])).eval()
    assert model.config.n_kv_head == 2 < model.config.n_head
    idx = torch.randint(0, 256, (3, 12))
    full = model(idx)
    cache = KVCache(model.config, 4, 64, dtype=torch.float32, device="cpu")
    assert cache.k.shape == (2, 4, 2, 64, 16)  # layers, slots, KV heads (not query heads), positions, head_dim
    slots = [3, 0, 2]
    for b, slot in enumerate(slots):  # each row prefilled alone into its slot, at different lengths
        n = 5 + b
        logits = model(idx[b: b + 1, :n], cache=cache, slots=torch.tensor([slot]), positions=torch.tensor([0]))
        torch.testing.assert_close(logits, full[b: b + 1, :n])
    for t in range(7, 12):  # then one batch step per token; rows 0 and 1 first catch up to position 7
        if t == 7:
            for b, start in ((0, 5), (1, 6)):
                model(idx[b: b + 1, start:7], cache=cache, slots=torch.tensor([slots[b]]),
                      positions=torch.tensor([start]))
        logits = model(idx[:, t: t + 1], cache=cache, slots=torch.tensor(slots), positions=torch.tensor([t] * 3))
        torch.testing.assert_close(logits[:, 0], full[:, t])


@pytest.mark.parametrize(("size", "billions", "tied"), [("llama3-1b", 1.24, True), ("llama3-8b", 8.03, False),
                                                        ("llama3-70b", 70.55, False), ("llama3-405b", 405.85, False)])
def test_presets_have_the_published_shapes(size, billions, tied) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(arch="llama", size=size))
    assert model.num_params() / 1e9 == pytest.approx(billions, abs=0.01)
    assert model.config.tie_embeddings == tied and model.config.vocab_size == 128256
    assert model.config.rope_scaling is not None and model.config.n_kv_head == 8
    c = model.config
    attention = 12 * c.n_layer * c.d_model * c.seq_len
    assert model.flops_per_token() == 6 * model.num_params(non_embedding=True) + attention
    assert model.num_params(non_embedding=True) == model.num_params() - (0 if tied else c.vocab_size * c.d_model)


def test_hf_names_and_shapes_are_the_modules() -> None:
    for tied in (True, False):
        config = LlamaConfig(**PRESETS["tiny"], tie_embeddings=tied)
        with torch.device("meta"):
            model = Llama(config)
        params = {hf.to_hf(n): tuple(p.shape) for n, p in model.named_parameters()}
        assert params == hf.expected_tensors(config)
        assert all(hf.to_hf(hf.from_hf(n)) == n for n in params)


def test_job_config_for_llama() -> None:
    cfg = config_from_dict({"model": {"arch": "llama", "size": "tiny", "n_kv_head": 1, "rope_scaling": {
        "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 32}}})
    config = arch_config(cfg.model)
    assert (config.n_head, config.n_kv_head, config.rope_scaling.original_max_position_embeddings) == (4, 1, 32)
    for data, match in [
        ({"arch": "llama", "size": "llama3-9b"}, r"(?s)'model\.size' is 'llama3-9b'.*did you mean 'llama3-8b'"),
        ({"arch": "llama", "mlp_ratio": 4}, r"'model\.mlp_ratio' applies to arch gpt, not llama"),
        ({"n_kv_head": 2}, r"'model\.n_kv_head' applies to arch llama, not gpt"),
        ({"init_from": "/x", "n_layer": 2}, r"'model\.n_layer' conflicts with model\.init_from"),
        ({"init_from": "/x", "arch": "gpt"}, r"init_from' loads a Hugging Face Llama"),
    ]:
        with pytest.raises(ShardstackError, match=match):
            config_from_dict({"model": data})
    with pytest.raises(ShardstackError, match=r"n_head \(4\) must be a multiple of n_kv_head \(3\)"):
        arch_config(config_from_dict({"model": {"arch": "llama", "size": "tiny", "n_kv_head": 3}}).model)


def test_estimate_plans_llama3_405b_on_the_meta_device(tmp_path) -> None:
    job = write_job(tmp_path / "job.yaml", model={"arch": "llama", "size": "llama3-405b"},
                    engine={"precision": "bf16"}, batch={"global_batch": 256, "micro_batch": 1})
    proc = shardstack("estimate", "--config", str(job), "--world-size", "512", "--stage", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    est = json.loads(proc.stdout)
    params = 405_853_388_800
    assert abs(est["params"] - 4 * params / 512) < 4 * 2**20  # fp32 master shards: 3.0 GiB per rank
    assert est["total"] == pytest.approx(16 * params / 512, rel=1e-3)
