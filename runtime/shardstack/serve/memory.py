"""The engine's memory, known before it is allocated: the KV cache of `slots` × `context` tokens is the one large
allocation the service makes after the weights, so it is checked against what the device has left and refused
with the numbers (and what would fit) instead of failing with an out-of-memory error, or taking the node's memory
from everything else, once it is allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardstack.errors import ShardstackError
from shardstack.model.kvcache import CacheShape

# Of what is free once the weights are in, what the KV cache may take: the rest is each step's working memory
# (a prefill chunk's activations and mask, bounded by --max-prefill-tokens) and the allocator's slack.
KV_CACHE_FRACTION = 0.9
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def kv_cache_bytes(config: CacheShape, slots: int, context: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for `slots` sequences of `context` tokens (model.kvcache.KVCache's size)."""
    per_token = 2 * config.n_layer * config.n_kv_head * config.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_token * slots * context


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup can still take (its limit less its usage; a systemd unit's MemoryMax=),
    None without a limit. cgroup v2 (the unified line "0::/path") or v1 (the "memory" controller's line)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            base, limit_file, usage_file = root / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = root / "memory" / path.lstrip("/"), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        limit, usage = _read_int(base / limit_file), _read_int(base / usage_file)
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            return max(0, limit - usage)
    return None


def host_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable, or less where the process's cgroup leaves less."""
    available = 0
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    room = cgroup_room()
    return available if room is None else min(available, room)


def free_bytes(device: torch.device) -> tuple[int, str]:
    """What `device` has free now, and how to name it in a message."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    return host_available(), "available in host memory"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_kv_cache(config: CacheShape, slots: int, context: int, dtype: torch.dtype, device: torch.device,
                   free: int | None = None) -> int:
    """The KV cache's bytes, if it fits KV_CACHE_FRACTION of what `device` has free (`free` overrides the
    measurement); otherwise a ShardstackError with the numbers and the largest context and slot count that fit."""
    need = kv_cache_bytes(config, slots, context, dtype)
    where = "given"
    if free is None:
        free, where = free_bytes(device)
    budget = int(free * KV_CACHE_FRACTION)
    if need <= budget:
        return need
    per_token = need // (slots * context)
    raise ShardstackError(
        f"the KV cache does not fit: {slots} slots × {context} tokens × {per_token} bytes per token "
        f"({config.n_layer} layers × {config.n_kv_head} KV heads × {config.head_dim} × 2, "
        f"{str(dtype).removeprefix('torch.')}) = {_gib(need)}, but {_gib(free)} is {where} with the weights "
        f"loaded and the cache may take {KV_CACHE_FRACTION:.0%} of it",
        hint=f"at most {budget // (per_token * slots)} tokens of context fit {slots} slots (--context, "
             f"inference_service_context), or {budget // (per_token * context)} slots the whole context "
             "(--max-concurrency)")
