"""The state-partitioning engine: ZeRO stages 0–3 built from torch's own parallel wrappers.

    stage 0  DDP                                   params, grads, optimizer states replicated
    stage 1  DDP + ZeroRedundancyOptimizer         optimizer states partitioned (whole tensors per rank)
    stage 2  FSDP2 fully_shard, reshard_after_forward=False
                                                   params, grads, states sharded at rest; the unsharded params
                                                   stay resident from forward through backward (no re-gather)
    stage 3  FSDP2 fully_shard, reshard_after_forward=True
                                                   as stage 2, but each block is freed after its forward and
                                                   gathered again for its backward

One transformer block is one FSDP unit; the root unit holds embeddings, final norm and the (tied) head. Gradients
are always the mean over the global batch. Accumulation sync (`engine.accumulation_sync`):
  "last"   non-final micro-batches skip gradient communication (DDP `no_sync`, FSDP2
           `set_requires_gradient_sync(False)`; stage 2 also keeps its params unsharded between micro-batches).
           Least communication; FSDP2 then holds unsharded gradients until the final micro-batch.
  "every"  every micro-batch reduces (all-reduce / reduce-scatter) and the sharded gradients accumulate.
           More communication, and FSDP2 never holds more than one block's unsharded gradient.
Clipping uses the L2 norm over all gradients of all ranks: for DTensor gradients the per-shard norms are combined
by DTensor's own reduction, so every rank scales by the same global coefficient (a local-only norm fails the
parity test). With tensor parallelism (engine.tensor_parallel) the loss is the same on the ranks of a "tp" group;
averaged over all ranks it is still the global-batch mean.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from shardstack.model.dtypes import to_dtype
from shardstack.train.config import EngineConfig, OptimizerConfig
from shardstack.train.dist import DistInfo
from shardstack.train.optim import make_optimizer, optimizer_param_groups
from shardstack.train.parallelize import parallelize

log = logging.getLogger("shardstack.engine")

# Allocates a meta-device model's parameters on a device and fills them (shardstack.train.build).
Materialize = Callable[[nn.Module, torch.device], None]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


@dataclass
class StepStats:
    grad_norm: float | None  # before clipping; None when clipping is off
    skipped: bool  # fp16: the scaler found inf/nan and skipped the update


class Engine:
    """A wrapped model and its optimizer for one ZeRO stage; `forward_backward` then `step` per optimizer step."""

    def __init__(self, module: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer, stage: int,
                 engine_cfg: EngineConfig, optim_cfg: OptimizerConfig, dist_info: DistInfo) -> None:
        self.module = module  # the unwrapped model (FSDP2 wraps in place, so for stages 2/3 it is `model`)
        self.model = model
        self.optimizer = optimizer
        self.stage = stage
        self.cfg = engine_cfg
        self.optim_cfg = optim_cfg
        self.dist = dist_info
        self.compute_dtype = to_dtype(engine_cfg.precision)
        self.scaler: torch.amp.GradScaler | None = None
        if engine_cfg.precision == "fp16":
            if stage >= 2:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                # Sharded grads: each rank sees only its shard, so found-inf must be all-reduced.
                self.scaler = ShardedGradScaler(device=dist_info.device.type)
            else:
                self.scaler = torch.amp.GradScaler(dist_info.device.type)
        self.last_memory: dict[str, int] | None = None

    # --- one optimizer step -------------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts through MixedPrecisionPolicy; DDP stages use autocast with fp32 master params.
        if self.stage >= 2 or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.compute_dtype)

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        sync = is_last or self.cfg.accumulation_sync == "every"
        if self.stage >= 2:
            assert isinstance(self.model, FSDPModule)
            self.model.set_requires_gradient_sync(sync)
            if self.stage == 2:
                # ZeRO-2 keeps params gathered across the micro-batches of one step; free them after the last.
                self.model.set_reshard_after_backward(sync)
            return contextlib.nullcontext()
        assert isinstance(self.model, DDP)
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def forward_backward(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Accumulate gradients over this rank's micro-batches; return the loss averaged over all ranks' tokens."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.dist.device, dtype=torch.float32)
        for i, (x, y) in enumerate(micro_batches):
            with self._sync_context(i == n - 1), self._autocast():
                loss = self.model(x, y)
            scaled = loss / n
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach().float()
        if self.dist.world_size > 1:
            dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        return float(total) / (n * self.dist.world_size)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        # Tensor parallelism leaves two meshes (2-D for the split projections, "dp" for the rest), and DTensor
        # cannot stack norms across meshes: one norm per mesh, combined here.
        by_mesh: dict[Any, list[nn.Parameter]] = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        norms = []
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
            # DTensor's norm reduces the squared shard norms across the mesh's ranks (torch 2.13 already returns it
            # Replicate; full_tensor() makes the reduction explicit should a version leave it Partial).
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if len(norms) != 1:
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=self.dist.device)
        else:
            total = norms[0]
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return float(total)

    def step(self, *, measure: bool = False) -> StepStats:
        """Unscale (fp16), clip by global norm, update, and free the gradients."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.optim_cfg.grad_clip:
            norm = self.clip_grad_norm(self.optim_cfg.grad_clip)
        skipped = False
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        if measure:
            self.last_memory = self.memory_breakdown()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm=norm, skipped=skipped)

    # --- memory -------------------------------------------------------------------------------------------------

    def _optimizer_states(self) -> Iterator[torch.Tensor]:
        opt = self.optimizer.optim if isinstance(self.optimizer, ZeroRedundancyOptimizer) else self.optimizer
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in its local shards: parameters, gradients and optimizer states (by device)."""
        params = list(self.module.parameters())
        out = {
            "params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_nbytes(t) for t in self._optimizer_states()),
        }
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["on_cpu"] = sum(_nbytes(t) for t in [*params, *(p.grad for p in params if p.grad is not None),
                                                  *self._optimizer_states()] if _local(t).device.type == "cpu")
        return out

    # --- world-size and stage independent state ------------------------------------------------------------------

    def _fqn_params(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    def _init_zero_state(self) -> None:
        """Materialise AdamW state for this rank's partition (a zero-gradient, lr=0 step on the local optimizer) so
        DCP has tensors to load into before the first real step, as torch's get_state_dict does for plain ones."""
        assert isinstance(self.optimizer, ZeroRedundancyOptimizer)
        local = self.optimizer.optim
        params = [p for g in local.param_groups for p in g["params"]]
        if not params or all(p in local.state for p in params):
            return
        lrs = [g["lr"] for g in local.param_groups]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in local.param_groups:
            g["lr"] = 0.0
        local.step()
        for g, lr in zip(local.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad

    def _zero_state_dict(self) -> dict[str, Any]:
        """ZeroRedundancyOptimizer in get_state_dict's FQN-keyed layout; each rank contributes only the parameters
        it owns, so the union over ranks is the full state and any world size can load its own partition."""
        self._init_zero_state()
        by_id = {id(p): fqn for fqn, p in self._fqn_params().items()}
        local = self.optimizer.optim
        state = {by_id[id(p)]: dict(local.state[p]) for g in local.param_groups for p in g["params"]}
        groups = []
        for g in self.optimizer.param_groups:
            meta = {k: v for k, v in g.items() if k != "params"}
            meta["params"] = [by_id[id(p)] for p in g["params"]]
            groups.append(meta)
        return {"state": state, "param_groups": groups}

    def _load_zero_state_dict(self, sd: dict[str, Any]) -> None:
        self._init_zero_state()
        by_id = {id(p): fqn for fqn, p in self._fqn_params().items()}
        local = self.optimizer.optim
        for g in local.param_groups:
            for p in g["params"]:
                saved = sd["state"][by_id[id(p)]]
                for k, v in saved.items():
                    cur = local.state[p].get(k)
                    if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                        cur.copy_(_local(v) if not isinstance(v, DTensor) else v.full_tensor())
                    else:
                        local.state[p][k] = v
        for i, g in enumerate(self.optimizer.param_groups):
            hyper = {k: v for k, v in sd["param_groups"][i].items() if k != "params"}
            g.update(hyper)
            local.param_groups[i].update(hyper)

    def state_dict(self) -> dict[str, Any]:
        """{"model": FQN → tensor, "optimizer": {"state": FQN → {...}, "param_groups": [...]}}; DTensor shards for
        stages 2/3, full tensors for 0/1 (stage 1 optimizer: only this rank's partition)."""
        if self.stage == 1:
            return {"model": get_model_state_dict(self.model), "optimizer": self._zero_state_dict()}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.stage == 1:
            set_model_state_dict(self.model, sd["model"], options=StateDictOptions(strict=True))
            self._load_zero_state_dict(sd["optimizer"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def build_engine(model: nn.Module, engine_cfg: EngineConfig, optim_cfg: OptimizerConfig, dist_info: DistInfo, *,
                 materialize: Materialize | None = None) -> Engine:
    """Wrap `model` for `engine_cfg.stage` and give it its optimizer.

    `model` is either initialised (identically on every rank) or on the meta device; then `materialize(module,
    device)` allocates and fills it: before DDP for stages 0/1, which replicate the whole model anyway, and after
    fully_shard for stages 2/3, where each rank allocates only its shards (on the host with CPU offload).
    """
    engine_cfg = engine_cfg.for_device(dist_info.device.type)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and materialize is None:
        raise ValueError("a model on the meta device needs `materialize`")
    if on_meta and engine_cfg.stage <= 1:
        materialize(model, dist_info.device)
    wrapped = parallelize(model, engine_cfg, dist_info)
    if on_meta and engine_cfg.stage >= 2:
        materialize(model, torch.device("cpu") if engine_cfg.offload == "cpu" else dist_info.device)
    module = wrapped.module if isinstance(wrapped, DDP) else wrapped
    # After materialising: the optimizer holds the parameters that carry the weights.
    optimizer = make_optimizer(optimizer_param_groups(module, optim_cfg.weight_decay), optim_cfg, engine_cfg.stage)
    return Engine(module, wrapped, optimizer, engine_cfg.stage, engine_cfg, optim_cfg, dist_info)
