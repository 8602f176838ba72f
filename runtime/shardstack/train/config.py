"""The job configuration: one typed object, loaded from YAML, validated with errors that name the key.

Every field has a documented default (docs/runtime.md lists them). Unknown keys are errors with a "did you mean"
suggestion; wrong types and values outside the allowed set name the full dotted key and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from shardstack.errors import ShardstackError
from shardstack.model.spec import (
    ARCHS,
    SECTION_KEYS,
    ModelConfig,
    arch_config,
    check_arch_keys,
    check_model_config,
    model_arch,
)
from shardstack.signing import DEFAULT_KEY_FILE

# This module is the job config on the controller too (`train submit` validates it there): no torch, here or below.
JOB_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # `train submit`'s rule (shardstack.ops.jobs.common.JOB_NAME)


@dataclass
class DataConfig:
    path: str | None = None  # a directory written by `shardstack data prepare`
    shuffle: bool = True  # a seeded permutation per epoch; False reads windows in order
    # The tokenizer path is prepared with: bytes, or a directory with tokenizer.json (e.g. init_from's). The cluster's
    # job task prepares path with it (null: bytes); the trainer refuses data prepared with another one.
    tokenizer: str | None = None


@dataclass
class EngineConfig:
    stage: Literal[0, 1, 2, 3] = 3  # 0 DDP, 1 DDP+ZeroRedundancyOptimizer, 2/3 FSDP2 without/with reshard
    offload: Literal["none", "cpu"] = "none"  # cpu: FSDP2 CPUOffloadPolicy (stages 2 and 3 only)
    # auto: bf16 on CUDA (tensor cores; master weights and optimizer state stay fp32), fp32 on CPU
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    prefetch: int = 1  # FSDP2: how many blocks ahead to all-gather (1 = FSDP2's implicit prefetch)
    reshard_group: int | None = None  # stage 3: reshard to groups of this many ranks after forward (e.g. per node)
    bucket_mb: float = 25.0  # DDP gradient bucket size (stages 0 and 1)
    accumulation_sync: Literal["last", "every"] = "last"  # reduce gradients on the last micro-batch or every one
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Recompute block activations in backward instead of keeping them: every block, or blocks 0, N, 2N, …
    # auto: full on CUDA (at long sequences activations, not shards, fill a GPU), none on CPU
    activation_checkpointing: Literal["auto", "none", "full", "every_n"] = "auto"
    activation_checkpointing_every: int | None = None  # N for every_n (required there, ≥ 2: every 1 block is full)
    compile: bool = False  # torch.compile (inductor) each block before it is wrapped
    # K > 1: a (world/K) × K mesh ("dp", "tp"); each block's attention heads and MLP columns split over the K ranks
    # of a "tp" group (torch tensor parallel), FSDP2 shards over "dp". Llama, stages 2/3 only (docs/runtime.md).
    tensor_parallel: int = 1

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with its `auto` settings settled for the device the job trains on (cuda or cpu)."""
        gpu = device_type == "cuda"
        return dataclasses.replace(
            self, precision=("bf16" if gpu else "fp32") if self.precision == "auto" else self.precision,
            activation_checkpointing=(("full" if gpu else "none") if self.activation_checkpointing == "auto"
                                      else self.activation_checkpointing))


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # global L2 norm across all shards; null or 0 = off
    impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"  # AdamW kernels; auto: fused on CUDA, else foreach


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100  # linear warm-up from 0 to optimizer.lr
    total_steps: int = 1000  # cosine decay ends here; also the default number of steps to train
    min_lr_ratio: float = 0.1  # the cosine ends at lr × min_lr_ratio


@dataclass
class BatchConfig:
    global_batch: int = 16  # sequences per optimizer step, over all ranks
    micro_batch: int | Literal["auto"] = 4  # sequences per rank per forward/backward
    accumulation: int | None = None  # derived as global / (micro × world); if set, it must agree
    cpu_memory_budget_mb: int | None = None  # micro_batch auto on CPU: budget per rank (default: half the free RAM)


@dataclass
class CheckpointConfig:
    dir: str | None = None
    interval: int = 100
    keep: int = 3  # the newest N valid checkpoints stay; 0 = keep all
    resume: str = "auto"  # "auto" | "never" | a step directory path
    async_save: bool | Literal["auto"] = "auto"  # auto: in the background on CUDA, inline on CPU
    # HMAC key that signs every manifest: on each node, readable by the job's account only, never on shared storage.
    signing_key_file: str = DEFAULT_KEY_FILE
    require_signature: bool = True  # false: save and resume unsigned checkpoints (a local single-user run)
    # Resume a checkpoint written under another config hash (model, data, optimizer, schedule, global batch, seed),
    # or one that predates the job name in the manifest (adopting it); refused otherwise. CLI: --allow-config-change.
    allow_config_change: bool = False

    def for_device(self, device_type: str) -> CheckpointConfig:
        """async_save settled: in the background on CUDA (the staging copy to host memory is what lets training go
        on), inline on CPU (the state is already in host memory: a staging copy would double it for no overlap)."""
        if self.async_save != "auto":
            return self
        return dataclasses.replace(self, async_save=device_type == "cuda")


@dataclass
class MetricsConfig:
    port: int | None = 9400  # rank 0 serves Prometheus here; 0 or null = off
    log_every: int = 1  # a JSON line and a progress line every N steps
    peak_tflops: float | None = None  # MFU denominator per device; null = known GPU table, or a CPU matmul probe
    json_log: str | None = None  # also append the JSON lines to this file (rank 0)


@dataclass
class JobConfig:
    # The job every checkpoint records as its owner; a checkpoint of another job is never resumed. null: the config
    # file's stem (`train run`), which is the job name on the cluster's nodes (<jobs_dir>/<job>.yaml).
    name: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    seed: int = 1337

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"model": self.model.to_dict()}  # the model section as the YAML has it

    def for_device(self, device_type: str) -> JobConfig:
        """This config with every `auto` that depends on the device settled for `device_type` (cuda or cpu): the one
        place the trainer, its log line and the checkpointer read them from."""
        return dataclasses.replace(self, engine=self.engine.for_device(device_type),
                                   checkpoint=self.checkpoint.for_device(device_type))

    def config_hash(self) -> str:
        """Hash of what defines the run's math (model, data, optimizer, schedule, global batch, seed).

        Engine layout, micro-batch, checkpoint and metrics settings are left out on purpose: a checkpoint may be
        resumed with another stage, world size or micro-batch and continue the same run. So is optimizer.impl,
        which picks the kernels of the same update.
        """
        d = self.to_dict()
        key = {k: d[k] for k in ("model", "data", "optimizer", "schedule", "seed")}
        del key["optimizer"]["impl"]
        key["global_batch"] = d["batch"]["global_batch"]
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# Checks beyond the type: (predicate, description of what is allowed).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "name": (lambda v: v is None or bool(JOB_NAME_RE.match(v)), "a job name ([a-z0-9_-], up to 63) or null"),
    "model.n_layer": (lambda v: v is None or v >= 1, "an integer ≥ 1"),
    "model.n_head": (lambda v: v is None or v >= 1, "an integer ≥ 1"),
    "model.d_model": (lambda v: v is None or v >= 1, "an integer ≥ 1"),
    "model.seq_len": (lambda v: v is None or v >= 2, "an integer ≥ 2"),
    "model.vocab_size": (lambda v: v is None or v >= 2, "an integer ≥ 2"),
    "model.n_kv_head": (lambda v: v is None or v >= 1, "an integer ≥ 1"),
    "model.ffn_dim": (lambda v: v is None or v >= 1, "an integer ≥ 1"),
    "model.norm_eps": (lambda v: v is None or v > 0, "a number > 0"),
    "model.rope_theta": (lambda v: v is None or v > 0, "a number > 0"),
    "model.dropout": (lambda v: v is None or 0 <= v < 1, "a number in [0, 1)"),
    "engine.prefetch": (lambda v: v >= 1, "an integer ≥ 1"),
    "engine.reshard_group": (lambda v: v is None or v >= 1, "an integer ≥ 1 or null"),
    "engine.bucket_mb": (lambda v: v > 0, "a number > 0"),
    "engine.activation_checkpointing_every": (lambda v: v is None or v >= 2, "an integer ≥ 2 or null"),
    "engine.tensor_parallel": (lambda v: v >= 1, "an integer ≥ 1"),
    "optimizer.lr": (lambda v: v > 0, "a number > 0"),
    "optimizer.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "optimizer.eps": (lambda v: v > 0, "a number > 0"),
    "optimizer.weight_decay": (lambda v: v >= 0, "a number ≥ 0"),
    "optimizer.grad_clip": (lambda v: v is None or v >= 0, "a number ≥ 0 or null"),
    "schedule.warmup_steps": (lambda v: v >= 0, "an integer ≥ 0"),
    "schedule.total_steps": (lambda v: v >= 1, "an integer ≥ 1"),
    "schedule.min_lr_ratio": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "batch.global_batch": (lambda v: v >= 1, "an integer ≥ 1"),
    "batch.micro_batch": (lambda v: v == "auto" or v >= 1, "an integer ≥ 1 or 'auto'"),
    "batch.accumulation": (lambda v: v is None or v >= 1, "an integer ≥ 1 or null"),
    "batch.cpu_memory_budget_mb": (lambda v: v is None or v >= 1, "an integer ≥ 1 or null"),
    "checkpoint.interval": (lambda v: v >= 1, "an integer ≥ 1"),
    "checkpoint.keep": (lambda v: v >= 0, "an integer ≥ 0 (0 keeps all)"),
    "metrics.port": (lambda v: v is None or 0 <= v <= 65535, "a port number 0–65535 or null"),
    "metrics.log_every": (lambda v: v >= 1, "an integer ≥ 1"),
    "metrics.peak_tflops": (lambda v: v is None or v > 0, "a number > 0 or null"),
}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked against the annotation `tp`, or raise naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ShardstackError:
                continue
    elif origin is Literal:
        # bool is an int in Python: `stage: true` must not pass as 1.
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, list | tuple):
            return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
    elif tp is str and isinstance(value, str):
        return value
    raise ShardstackError(f"config key '{key}' is {value!r}; expected {_describe(tp)}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        where = f"section '{prefix}'" if prefix else "the config"
        raise ShardstackError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else (
                "allowed keys: " + ", ".join(names))
            raise ShardstackError(f"unknown config key '{dotted}'", hint=hint)
    kwargs: dict[str, Any] = {}
    for name in names:
        if name not in data:
            continue
        dotted = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if tp is ModelConfig:
            kwargs[name] = _build_model(data[name] if data[name] is not None else {}, dotted)
            continue
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name] if data[name] is not None else {}, dotted)
            continue
        value = _coerce(data[name], tp, dotted)
        check = _CHECKS.get(dotted)
        if check and not check[0](value):
            raise ShardstackError(f"config key '{dotted}' is {value!r}; expected {check[1]}")
        kwargs[name] = value
    return cls(**kwargs)


def _build_model(data: dict[str, Any], prefix: str) -> ModelConfig:
    """The flat `model:` section: arch, size, init_from, factory as keys of ModelConfig, the rest typed by the arch's
    overrides. A key of another arch is named as such; None is unset (a recorded job config lists every key)."""
    if not isinstance(data, dict):
        raise ShardstackError(f"section '{prefix}' must be a mapping, got {type(data).__name__}")
    names = [*SECTION_KEYS, *dict.fromkeys(n for spec in ARCHS.values() for n in spec.field_names())]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            raise ShardstackError(f"unknown config key '{prefix}.{key}'",
                                  hint=f"did you mean '{prefix}.{close[0]}'?" if close else
                                  "allowed keys: " + ", ".join(names))
    cfg = _build(ModelConfig, {k: v for k, v in data.items() if k in SECTION_KEYS}, prefix)
    spec = ARCHS[model_arch(cfg)]
    rest = {k: v for k, v in data.items() if k not in SECTION_KEYS and v is not None}
    if cfg.factory is None:  # a user model's section ignores the shape keys, as it always has
        check_arch_keys(spec, rest)
    cfg.overrides = _build(spec.fields, {k: v for k, v in rest.items() if k in spec.field_names()}, prefix)
    return cfg


def _cross_checks(cfg: JobConfig) -> None:
    check_model_config(cfg.model)
    if cfg.engine.offload == "cpu" and cfg.engine.stage < 2:
        raise ShardstackError(
            f"config key 'engine.offload' is 'cpu' but engine.stage is {cfg.engine.stage}",
            hint="CPU offload shards through FSDP2: use engine.stage 2 or 3, or offload: none",
        )
    if cfg.engine.reshard_group is not None and cfg.engine.stage != 3:
        raise ShardstackError("config key 'engine.reshard_group' applies to engine.stage 3 only")
    every = cfg.engine.activation_checkpointing_every
    if cfg.engine.activation_checkpointing == "every_n" and every is None:
        raise ShardstackError(
            "config key 'engine.activation_checkpointing' is 'every_n' but engine.activation_checkpointing_every "
            "is not set", hint="set engine.activation_checkpointing_every: N (≥ 2) to recompute every N-th block")
    if every is not None and cfg.engine.activation_checkpointing != "every_n":
        raise ShardstackError(
            f"config key 'engine.activation_checkpointing_every' applies to activation_checkpointing 'every_n', "
            f"not {cfg.engine.activation_checkpointing!r}",
            hint="set engine.activation_checkpointing: every_n, or remove activation_checkpointing_every")
    if cfg.engine.tensor_parallel > 1:
        _check_tensor_parallel(cfg)
    if cfg.schedule.warmup_steps > cfg.schedule.total_steps:
        raise ShardstackError(
            f"config key 'schedule.warmup_steps' ({cfg.schedule.warmup_steps}) exceeds schedule.total_steps "
            f"({cfg.schedule.total_steps})"
        )


def _check_tensor_parallel(cfg: JobConfig) -> None:
    """What engine.tensor_parallel combines with; the world size is checked when the mesh is built (dist.py)."""
    k, eng = cfg.engine.tensor_parallel, cfg.engine
    key = f"config key 'engine.tensor_parallel' is {k}"
    # Each limit below is a combination the tests do not cover, refused rather than left to misbehave.
    if eng.stage < 2:
        raise ShardstackError(f"{key} but engine.stage is {eng.stage}",
                              hint="tensor parallelism composes with FSDP2 only: use engine.stage 2 or 3")
    for name, on in (("offload", eng.offload != "none"), ("reshard_group", eng.reshard_group is not None),
                     ("compile", eng.compile)):
        if on:
            raise ShardstackError(f"{key}, which does not combine with engine.{name}",
                                  hint=f"unset engine.{name}, or set engine.tensor_parallel: 1")
    if cfg.batch.micro_batch == "auto":
        raise ShardstackError(f"{key}, which does not combine with batch.micro_batch 'auto'",
                              hint="set batch.micro_batch to a number (`shardstack estimate` helps to pick it)")
    if cfg.model.factory is not None or ARCHS[model_arch(cfg.model)].tp_plan is None:
        raise ShardstackError(
            f"{key}, but the model is {'model.factory' if cfg.model.factory else 'arch ' + model_arch(cfg.model)}",
            hint="tensor parallelism splits the Llama family's separate q/k/v projections across ranks (the GPT's "
                 "fused qkv projection cannot be split by heads); use model.arch: llama")
    if cfg.model.init_from is not None:
        return  # its config.json is read on the cluster; parallelize() checks the heads there
    shape = arch_config(cfg.model)
    for name, n in (("n_head", shape.n_head), ("n_kv_head", shape.n_kv_head)):
        if n % k:
            raise ShardstackError(f"{key}, but model.{name} ({n}) is not divisible by it",
                                  hint="each tensor-parallel rank computes n_head / K query and n_kv_head / K "
                                       "key/value heads: pick K dividing both")


def config_from_dict(data: dict[str, Any] | None) -> JobConfig:
    cfg = _build(JobConfig, data or {}, "")
    _cross_checks(cfg)
    return cfg


def job_name_from_path(path: str | Path) -> str:
    """The job name of a config without `name`: its file's stem, as `train submit` names the job and the nodes
    name its config file (<jobs_dir>/<job>.yaml)."""
    stem = Path(path).stem.lower().replace(".", "-")
    if not JOB_NAME_RE.match(stem):
        raise ShardstackError(f"{path} sets no name and its file name {stem!r} is not a job name",
                              hint="set name: <job> ([a-z0-9_-], up to 63) in the job config")
    return stem


def read_yaml(path: str | Path) -> Any:
    """A YAML file's document; an unreadable file or bad YAML is one line that says where."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ShardstackError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ShardstackError(f"{path} is not valid YAML{where}") from None


def typed(cls: type, data: Any) -> Any:
    """A mapping as the dataclass `cls`, by the job config's rules: unknown keys (with a suggestion), wrong types and
    bad values are errors that name the key. For other typed configs (ops.autoscale's)."""
    return _build(cls, data if data is not None else {}, "")


def load_config(path: str | Path) -> JobConfig:
    return config_from_dict(read_yaml(path))
