"""The memory estimator's formulas (the measured side is in test_distributed.py)."""

from __future__ import annotations

import json

import torch
from shardstack.cli import main
from shardstack.train.config import config_from_dict
from shardstack.train.memory.estimate import estimate, local_elements, zero_partition


def test_fsdp_chunking_rule():
    t = torch.empty(15, 4, device="meta")
    assert [local_elements(t, 2, r) for r in range(2)] == [32, 28]
    assert [local_elements(torch.empty(3, device="meta"), 4, r) for r in range(4)] == [1, 1, 1, 0]


def test_zero_partition_is_greedy_largest_first():
    sizes = [torch.empty(n, device="meta") for n in (10, 7, 5, 4)]
    owned = zero_partition([sizes[:2], sizes[2:]], 2)
    assert [[p.numel() for p in r] for r in owned] == [[10, 4], [7, 5]]


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
    assert e[3].offloaded == e[3].total and e[3].peak == on_device[3].peak - e[3].total


def test_cli_json(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("model: {size: tiny}\n")
    assert main(["estimate", "--config", str(job), "--world-size", "4", "--json", "--stage", "3"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["stage"], r["world_size"]) for r in rows] == [(3, 4)]
