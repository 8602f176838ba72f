"""Per-rank memory estimator: what each ZeRO stage keeps of parameters, gradients and optimizer states, plus the
working set, activations and optimizer temporaries of a step. The formulas (docs/runtime.md, "Memory estimator"):

  E = Σ elements of the parameters (tied weights once), T = number of parameter tensors, N = world size,
  shard_r(t) = elements of tensor t on rank r when split on dim 0 as FSDP2 does (torch.chunk: ⌈d0/N⌉ rows per rank)

  stage 0   params 4E            grads 4E             AdamW 8E + 4T (exp_avg, exp_avg_sq fp32; a step scalar each)
  stage 1   params 4E            grads 4E             AdamW over the tensors ZeroRedundancyOptimizer assigns to r
                                                       (its greedy largest-first partition, reproduced here)
  stage 2/3 params 4·Σ shard_r   grads 4·Σ shard_r    AdamW 8·Σ shard_r + 4T

Tensor parallelism (engine.tensor_parallel K, stages 2/3): the projections its architecture's tp_plan splits hold 1/K of
their columns (colwise: dim 0, rowwise: dim 1; torch.chunk sizes at the rank's "tp" coordinate) before FSDP2
splits dim 0 over the N/K "dp" ranks; the other tensors are split over the N/K "dp" ranks only. The working
parameters and the activations inside a block's attention and MLP shrink by K as well (block_widths).

Master params, gradients and states stay fp32 under every precision (bf16/fp16 only change the compute copies).
Forward/backward adds the working parameters (stage 2: every block unsharded in the compute dtype from forward to
backward; stage 3: (1 + prefetch) blocks plus the root), with accumulation_sync "last" on FSDP2 unsharded fp32
gradients on non-final micro-batches, and the activations (`activation_bytes`); the optimizer step adds AdamW's
temporaries (`optimizer_temporaries`) and, on FSDP2 stages, the sharded gradients, which exist only from backward
to zero_grad. The activations are freed before the step, so the peak is what a rank holds between steps plus the
larger of the two (bench/memory.py measures it). torch.compile changes none of this: compiled blocks save the
same tensors for backward, and parameters and optimizer are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from shardstack.errors import ShardstackError
from shardstack.model.decoder import arch_spec
from shardstack.model.dtypes import to_dtype
from shardstack.model.init import CHUNK_ELEMENTS
from shardstack.model.shapes import GPTConfig, LlamaConfig
from shardstack.model.spec import ModelShape, build_model
from shardstack.train.config import EngineConfig, JobConfig
from shardstack.train.optim import auto_impl, optimizer_param_groups
from shardstack.train.parallelize import checkpointed_blocks, shard_units

FP32 = 4
DDP_BROADCAST_BUCKET = 250 * 2**20  # DDP flattens what it broadcasts at construction into buckets of this size


@dataclass
class StageEstimate:
    stage: int
    world_size: int
    rank: int
    params: int
    grads: int
    optimizer: int
    total: int  # params + grads + optimizer: what the local shards hold between steps
    working_params: int  # unsharded compute-dtype parameters during forward/backward (FSDP: + a block's gradients)
    accumulation_grads: int  # extra unsharded gradients held on non-final micro-batches ("last" sync, FSDP)
    activations: int  # per micro-batch, approximate
    optimizer_impl: str  # fused | foreach | for_loop, as the run resolves optimizer.impl
    optimizer_temporaries: int  # transient bytes inside optimizer.step
    peak: int  # the highest point of a step once AdamW's state exists: what micro_batch auto must fit
    first_step_peak: int  # the first step's, lower: AdamW's state is created in its optimizer.step
    init_peak: int  # while the engine is built: DDP stages the whole model plus DDP's buffers, FSDP its shards
    offloaded: int  # of `total`, what CPUOffloadPolicy keeps in host memory
    micro_batch: int
    checkpointed_blocks: int  # blocks whose activations are recomputed in backward
    precision: str  # engine.precision as the device settles `auto`
    activation_checkpointing: str  # the same for engine.activation_checkpointing


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    per = math.ceil(rows / world)
    return max(0, min(per, rows - rank * per))


def local_elements(t: torch.Tensor, world: int, rank: int) -> int:
    """Elements of `t` that FSDP2 places on `rank` (Shard(0), torch.chunk sizes)."""
    if t.dim() == 0:
        return t.numel() if rank == 0 else 0
    rest = t.numel() // t.shape[0] if t.shape[0] else 0
    return _chunk_rows(t.shape[0], world, rank) * rest


def zero_partition(groups: list[list[torch.Tensor]], world: int) -> list[list[torch.Tensor]]:
    """ZeroRedundancyOptimizer's partition: per group, largest tensors first, each to the least-loaded rank."""
    sizes = [0] * world
    owned: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for params in groups:
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            r = sizes.index(min(sizes))
            owned[r].append(p)
            sizes[r] += p.numel()
    return owned


def block_widths(cfg: ModelShape, tp: int = 1) -> tuple[float, float]:
    """(saved, gradients): what one block keeps for backward and the activation gradients of its backward, in d-wide
    tensors per token (t = b·s·d·e each). Counted with autograd's saved-tensor hooks on CPU (tests/runtime/
    test_estimate.py checks both architectures). f = MLP width / d, kv = key/value width / d.

    GPT: the two LayerNorm inputs and their outputs as Linear inputs, the attention output (5), q, k, v (3) and the
    MLP's two f-wide tensors: 8 + 2·f (16 at f = 4). Llama: the two RMSNorm inputs, their normalised values and
    outputs, the attention output (7), q, k and v after RoPE (1 + 2·kv) and SwiGLU's four f-wide tensors (gate, its
    SiLU, up, their product): 8 + 2·kv + 4·f. A model.factory model is counted as the GPT.

    With `tp`-way tensor parallelism (Llama only) a rank keeps its heads' attention output, q, k, v and its slice of
    the SwiGLU tensors: 6 + (2 + 2·kv + 4·f) / tp saved, 1 + 3·f / tp gradients; the norms' tensors stay whole.
    """
    if isinstance(cfg, LlamaConfig):
        f, kv = cfg.ffn_dim / cfg.d_model, cfg.n_kv_head * cfg.head_dim / cfg.d_model
        return 6 + (2 + 2 * kv + 4 * f) / tp, 1 + 3 * f / tp
    f = cfg.mlp_ratio if isinstance(cfg, GPTConfig) else 4
    return 8 + 2 * f, 1 + 2 * f


def activation_bytes(model: nn.Module, micro_batch: int, seq_len: int, compute_bytes: int,
                     checkpointed: Sequence[int] = (), tp: int = 1) -> int:
    """The activations' high point in forward/backward for one micro-batch, the `checkpointed` blocks recomputed.

    A block keeps `saved`·t (block_widths), t = b·s·d·e; a checkpointed block keeps only its input (t). Backward
    runs the blocks last to first, each block's tensors freed after it; a checkpointed block first gets back the
    (saved − 1)·t beside its input. Backward through a block adds the gradients of its activations, and the head
    keeps the logits and, in fp32, their log-softmax and its gradient: b·s·V·(e + 8).
    """
    n_layer, token, saved, block, logits = _activation_terms(model, micro_batch, seq_len, compute_bytes, tp)
    recomputed = set(checkpointed)
    high = kept = 0
    for i in range(n_layer):  # the blocks' share when backward reaches block i
        kept += token if i in recomputed else saved
        high = max(high, kept + (saved - token if i in recomputed else 0))
    return high + block - saved + logits


def _activation_terms(model: nn.Module, micro_batch: int, seq_len: int, compute_bytes: int,
                      tp: int = 1) -> tuple[int, ...]:
    """(layers, one d-wide tensor, one block's saved tensors, one block in backward: its saved tensors and their
    gradients, the head)."""
    cfg = model.config
    n_layer = cfg.n_layer
    token = micro_batch * seq_len * cfg.d_model * compute_bytes
    saved, grads = block_widths(cfg, tp)
    logits = micro_batch * seq_len * cfg.vocab_size * (compute_bytes + 8)
    return n_layer, token, round(saved * token), round((saved + grads) * token), logits


def tp_split_dims(model: nn.Module) -> dict[int, int]:
    """id(parameter) → the dim tensor parallelism splits it on, from the architecture's tp_plan (a rowwise bias is
    whole)."""
    dims: dict[int, int] = {}
    spec = arch_spec(model)
    plan = spec.tp_plan if spec is not None and spec.tp_plan is not None else {}
    for unit in shard_units(model):
        for path, style in plan.items():
            for name, p in unit.get_submodule(path).named_parameters(recurse=False):
                if style == "colwise" or name == "weight":
                    dims[id(p)] = 0 if style == "colwise" else 1
    return dims


def optimizer_temporaries(groups: list[list[int]], impl: str) -> int:
    """Bytes AdamW allocates transiently inside `step`, from the per-group local element counts of each tensor.

    foreach: one sqrt(exp_avg_sq) list per parameter group (grouped by device and dtype: 4 bytes × the group's
    elements), freed before the next group; for_loop: sqrt and the division for one tensor at a time (2 × 4 bytes
    × the largest tensor); fused: none.
    """
    if impl == "foreach":
        return FP32 * max((sum(g) for g in groups), default=0)
    if impl == "for_loop":
        return 2 * FP32 * max((n for g in groups for n in g), default=0)
    return 0


def estimate_stage(model: nn.Module, engine: EngineConfig, stage: int, world: int, rank: int, *,
                   weight_decay: float, micro_batch: int, seq_len: int, accumulation: int = 1,
                   optimizer_impl: str = "auto", device_type: str | None = None) -> StageEstimate:
    """One rank's bytes at `stage`. `device_type` is where the model trains (default: where its parameters are);
    `optimizer_impl` "auto" resolves as make_optimizer does. `world` counts all ranks; with
    engine.tensor_parallel K, rank r is "dp" rank r // K and "tp" rank r % K (DistInfo.dp)."""
    tp = engine.tensor_parallel
    if tp > 1 and (stage < 2 or world % tp):
        raise ShardstackError(f"engine.tensor_parallel {tp} needs engine.stage 2 or 3 and a world size divisible by "
                              f"it (stage {stage}, world size {world})")
    params = [p for p in model.parameters() if p.requires_grad]
    device_type = device_type or (params[0].device.type if params else "cpu")
    engine = engine.for_device(device_type)
    # Offloaded parameters live on the host, and so does their optimizer step.
    impl = optimizer_impl if optimizer_impl != "auto" else auto_impl("cpu" if engine.offload == "cpu" else device_type)
    n_elem = sum(p.numel() for p in params)
    n_tensors = len(params)
    compute_bytes = torch.empty((), dtype=to_dtype(engine.precision)).element_size()
    units = shard_units(model)
    root_elem = n_elem - sum(p.numel() for u in units for p in u.parameters())
    groups = [g["params"] for g in optimizer_param_groups(model, weight_decay)]
    # The seeded init draws a tensor's rows in chunks of ~CHUNK_ELEMENTS (at least one row) into a scratch tensor.
    # Shapes only: indexing a sharded (DTensor) parameter would be a collective.
    scratch = FP32 * max((min(p.numel(), max(CHUNK_ELEMENTS, math.prod(p.shape[1:]))) for p in params), default=0)
    accumulation_grads = 0
    if stage <= 1:
        p_b = g_b = FP32 * n_elem
        if stage == 0:
            o_b = 2 * FP32 * n_elem + FP32 * n_tensors
            local_groups = [[p.numel() for p in g] for g in groups]
        else:
            mine = {id(p) for p in zero_partition(groups, world)[rank]}
            o_b = sum(2 * FP32 * p.numel() + FP32 for g in groups for p in g if id(p) in mine)
            local_groups = [[p.numel() for p in g if id(p) in mine] for g in groups]
        working = 0 if engine.precision == "fp32" else compute_bytes * n_elem  # autocast's cached casts
        # Beside the model, DDP's construction broadcasts it through a flattened bucket and then allocates the
        # gradient buckets (4E). The CUDA allocator counts those at once; on CPU their pages become resident only
        # when the first backward writes them.
        buckets = FP32 * n_elem if device_type == "cuda" else 0
        init = FP32 * n_elem + max(min(FP32 * n_elem, DDP_BROADCAST_BUCKET), buckets, scratch)
    else:
        split = tp_split_dims(model) if tp > 1 else {}

        def tp_local(p: torch.Tensor) -> torch.Tensor:  # shape only: this "tp" rank's part of `p`, on meta
            shape = list(p.shape)
            if id(p) in split:
                shape[split[id(p)]] = _chunk_rows(shape[split[id(p)]], tp, rank % tp)
            return torch.empty(shape, device="meta")

        def local(p: torch.Tensor) -> int:
            return local_elements(tp_local(p), world // tp, rank // tp)

        shard = sum(local(p) for p in params)
        p_b = g_b = FP32 * shard
        o_b = 2 * FP32 * shard + FP32 * n_tensors
        local_groups = [[local(p) for p in g] for g in groups]
        tp_elem = sum(tp_local(p).numel() for p in params)  # unsharded over "dp": what FSDP2 gathers
        block_elem = max(sum(tp_local(p).numel() for p in u.parameters()) for u in units)
        # Backward holds a block's unsharded gradients (or the fp32 reduce-scatter input copied from them) until
        # they are reduced, and reshards each block then, at either stage: late in backward only the root and
        # (1 + prefetch) blocks are gathered — stage 3's working set all along.
        staging = FP32 * block_elem
        late_working = compute_bytes * (root_elem + min(len(units), 1 + engine.prefetch) * block_elem) + staging
        working = compute_bytes * tp_elem + staging if stage == 2 else late_working
        if accumulation > 1 and engine.accumulation_sync == "last":
            accumulation_grads = FP32 * tp_elem
        # Built on the meta device and sharded there: a rank allocates its shards only, then fills them chunk by
        # chunk (shardstack.model.init).
        init = p_b + scratch
    total = p_b + g_b + o_b
    offloaded = total if engine.offload == "cpu" else 0
    recomputed = checkpointed_blocks(len(units), engine.activation_checkpointing,
                                     engine.activation_checkpointing_every)
    act = activation_bytes(model, micro_batch, seq_len, compute_bytes, recomputed, tp)
    temps = optimizer_temporaries(local_groups, impl)
    fwd_bwd = working + accumulation_grads + act  # at the start of backward
    if offloaded:  # the host holds the state and runs the step; the device sees forward/backward only
        peak = first = fwd_bwd
    else:
        # Between steps a rank holds parameters, AdamW state and, on DDP stages, the gradient buckets (they outlive
        # zero_grad); FSDP2's sharded gradients exist from the reduce-scatter in backward until zero_grad, when the
        # activations are already freed. Before the first optimizer.step there is no AdamW state.
        held = p_b + o_b + (g_b if stage <= 1 else 0)
        if stage >= 2:
            # As backward frees activations, the sharded gradients build up: with checkpointing (few activations
            # kept) the highest point is the last block's backward, with nearly all gradients reduced.
            fwd_bwd = max(fwd_bwd, g_b + late_working + _activation_terms(model, micro_batch, seq_len,
                                                                          compute_bytes, tp)[3])
        at_step = (g_b if stage >= 2 else 0) + temps
        peak = held + max(fwd_bwd, at_step)
        first = held - o_b + max(fwd_bwd, o_b + at_step)
    return StageEstimate(stage=stage, world_size=world, rank=rank, params=p_b, grads=g_b, optimizer=o_b, total=total,
                         working_params=working, accumulation_grads=accumulation_grads, activations=act,
                         optimizer_impl=impl, optimizer_temporaries=temps, peak=peak, first_step_peak=first,
                         init_peak=init, offloaded=offloaded, micro_batch=micro_batch,
                         checkpointed_blocks=len(recomputed), precision=engine.precision,
                         activation_checkpointing=engine.activation_checkpointing)


def estimate(cfg: JobConfig, world: int, *, stages: list[int] | None = None, rank: int | None = None,
             micro_batch: int | None = None) -> list[StageEstimate]:
    """One estimate per stage; `rank=None` reports the rank that holds the most (ranks differ only by rounding).

    The device is the config's (`auto`: CUDA if this machine has it), which decides `optimizer.impl: auto`."""
    device_type = cfg.engine.device if cfg.engine.device != "auto" else \
        "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = build_model(cfg.model)
    seq_len = model.config.seq_len
    tp = cfg.engine.tensor_parallel
    if world % tp:
        raise ShardstackError(f"config key 'engine.tensor_parallel' is {tp}, but the world size ({world}) is not "
                              "divisible by it")
    mb = micro_batch or (cfg.batch.micro_batch if isinstance(cfg.batch.micro_batch, int) else 1)
    accum = max(1, cfg.batch.global_batch // (mb * (world // tp)))
    out = []
    for stage in stages if stages is not None else [0, 1, 2, 3] if tp == 1 else [2, 3]:
        if stage < 2 and tp > 1:
            raise ShardstackError(f"stage {stage} does not combine with engine.tensor_parallel {tp}",
                                  hint="tensor parallelism composes with FSDP2: stages 2 and 3")
        eng = EngineConfig(**{**asdict(cfg.engine), "stage": stage,
                              "offload": cfg.engine.offload if stage >= 2 else "none"})
        # FSDP2's Shard(0) gives the first ranks full torch.chunk rows, and tensor parallel splits evenly, so at
        # stages 0, 2 and 3 rank 0 holds the most of every tensor; ZeroRedundancyOptimizer's partition (stage 1) can
        # favour any rank.
        ranks = [rank] if rank is not None else range(world) if stage == 1 else [0]
        per_rank = [estimate_stage(model, eng, stage, world, r, weight_decay=cfg.optimizer.weight_decay,
                                   micro_batch=mb, seq_len=seq_len, accumulation=accum,
                                   optimizer_impl=cfg.optimizer.impl, device_type=device_type) for r in ranks]
        out.append(max(per_rank, key=lambda e: e.peak))
    return out
