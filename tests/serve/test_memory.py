"""The KV cache is checked before it is allocated (serve.memory): its size from the model's shape, what the device
has left measured for real (MemAvailable and the process's cgroup here), and a refusal that names the numbers and
what would fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shardstack.errors import ShardstackError
from shardstack.model.kvcache import KVCache
from shardstack.model.llama import LlamaConfig
from shardstack.serve.memory import KV_CACHE_FRACTION, cgroup_room, check_kv_cache, host_available, kv_cache_bytes

# Llama 3.1 8B's attention shape: 32 layers, 8 KV heads of 128, and the 131072-token context its config.json says.
LLAMA_8B = LlamaConfig(vocab_size=128256, seq_len=131072, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                       ffn_dim=14336)


def test_the_estimate_is_the_size_of_the_cache_the_engine_allocates() -> None:
    small = LlamaConfig(vocab_size=256, seq_len=64, n_layer=3, n_head=4, n_kv_head=2, d_model=32, ffn_dim=64)
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(small, 5, 64, dtype=dtype, device="cpu")
        real = 2 * cache.k.numel() * cache.k.element_size()
        assert kv_cache_bytes(small, 5, 64, dtype) == real
    # The figure: 8 slots of the whole context in bf16 are 128 GiB.
    assert kv_cache_bytes(LLAMA_8B, 8, 131072, torch.bfloat16) == 128 * 2**30


def test_a_cache_that_does_not_fit_is_refused_with_the_numbers_and_what_fits() -> None:
    free = 80 * 2**30  # an 80 GiB GPU after the weights
    with pytest.raises(ShardstackError) as err:
        check_kv_cache(LLAMA_8B, 8, 131072, torch.bfloat16, torch.device("cuda"), free=free)
    text = str(err.value)
    assert "8 slots × 131072 tokens × 131072 bytes per token" in text
    assert "(32 layers × 8 KV heads × 128 × 2, bfloat16) = 128.0 GiB, but 80.0 GiB is given" in text
    fits = int(free * KV_CACHE_FRACTION) // (131072 * 8)
    assert f"at most {fits} tokens of context fit 8 slots" in text and "or 4 slots the whole context" in text
    # ...and what it proposes does fit.
    assert check_kv_cache(LLAMA_8B, 8, fits, torch.bfloat16, torch.device("cuda"), free=free) <= free
    assert check_kv_cache(LLAMA_8B, 4, 131072, torch.bfloat16, torch.device("cuda"), free=free) <= free


def test_host_memory_is_what_this_machine_has_left() -> None:
    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines}
    available = host_available()
    assert 0 < available <= meminfo["MemAvailable"] * 1.05  # it moves between the two reads
    # The whole 8B cache does not fit this machine (24 GiB): refused before a byte is allocated.
    with pytest.raises(ShardstackError, match="available in host memory"):
        check_kv_cache(LLAMA_8B, 8, 131072, torch.bfloat16, torch.device("cpu"))


def test_a_cgroup_limit_bounds_the_room(tmp_path: Path) -> None:
    # The files a systemd unit's MemoryMax= leaves, in both hierarchies (written here: a test cannot set a limit).
    v2 = tmp_path / "v2"
    (v2 / "system.slice" / "x.service").mkdir(parents=True)
    (v2 / "system.slice" / "x.service" / "memory.max").write_text("1073741824\n")
    (v2 / "system.slice" / "x.service" / "memory.current").write_text("268435456\n")
    (tmp_path / "cg2").write_text("0::/system.slice/x.service\n")
    assert cgroup_room(tmp_path / "cg2", v2) == 768 * 2**20
    (v2 / "system.slice" / "x.service" / "memory.max").write_text("max\n")
    assert cgroup_room(tmp_path / "cg2", v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "u").mkdir(parents=True)
    (v1 / "memory" / "u" / "memory.limit_in_bytes").write_text(str(2**30))
    (v1 / "memory" / "u" / "memory.usage_in_bytes").write_text(str(2**29))
    (tmp_path / "cg1").write_text("12:cpu,cpuacct:/u\n4:memory:/u\n0::/u\n")
    assert cgroup_room(tmp_path / "cg1", v1) == 2**29
    (v1 / "memory" / "u" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert cgroup_room(tmp_path / "cg1", v1) is None
