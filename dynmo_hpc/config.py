"""Job configuration: a YAML file loaded strictly into frozen, typed dataclasses.

Why strict: a typo in a batch job (``num_microbatch: 8``) that is silently ignored costs a queue
wait plus a wasted allocation. Every unknown key, wrong type and impossible combination is rejected
before any rank starts, with an error naming the key, the file and the fix.

Adding a section: write a frozen keyword-only dataclass with a docstring under each field, add it as
a field of :class:`JobConfig`, and put cross-field checks in its ``validate`` method.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A job configuration problem; the message names the key, the source and the fix."""


@dataclass(frozen=True, kw_only=True)
class JobSection:
    name: str = "default"
    """Job name; the run directory is ``<out_dir>/<name>``."""
    seed: int = 1337
    """Seed for weights (per global layer index) and for batches (per step)."""
    out_dir: str = "runs"
    """Directory under which ``<name>/`` holds the config, checkpoint and run log."""

    def validate(self) -> None:
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ConfigError(
                f"job.name={self.name!r} must be a non-empty name without '/', '\\' or spaces"
            )


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    num_layers: int = 8
    """Transformer blocks. The pipeline places num_layers + 2 layers: embedding, blocks, head."""
    d_model: int = 128
    """Residual stream width."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    d_ff: int = 512
    """Feed-forward hidden width (4 * d_model in GPT-2)."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab_size: int = 256
    """Byte-level tokens: 256."""
    layer_d_ff: list[int] | None = None
    """Optional per-block feed-forward widths (length num_layers) to build an imbalanced model."""

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding + blocks + head: the units the partitioner places."""
        return self.num_layers + 2

    def validate(self) -> None:
        for key in ("num_layers", "d_model", "num_heads", "d_ff", "seq_len", "vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"model.d_model({self.d_model}) % model.num_heads({self.num_heads}) != 0; "
                "choose num_heads dividing d_model"
            )
        if self.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size={self.vocab_size} < 256; byte-level tokens need 256"
            )
        if self.layer_d_ff is not None:
            if len(self.layer_d_ff) != self.num_layers:
                raise ConfigError(
                    f"model.layer_d_ff has {len(self.layer_d_ff)} entries but "
                    f"model.num_layers={self.num_layers}; give one width per block"
                )
            if any(w < 1 for w in self.layer_d_ff):
                raise ConfigError("model.layer_d_ff entries must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DataSection:
    path: str | None = None
    """UTF-8 text file to train on; null uses the English docs that ship with CPython."""
    val_fraction: float = 0.1
    """Tail fraction of the text held out for validation."""

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.path is not None and not Path(self.path).is_file():
            raise ConfigError(
                f"data.path={self.path!r} is not a file; give a UTF-8 text file or null"
            )


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    steps: int = 60
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per microbatch."""
    num_microbatches: int = 8
    """Microbatches per step (gradient accumulation); pipeline parallelism needs several."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of cosine decay."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices only)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (across all stages); 0 disables it."""
    log_interval: int = 5
    """Steps between progress lines on rank 0."""
    checkpoint: bool = True
    """Write a final checkpoint (per global layer: weights and optimizer state)."""

    def validate(self) -> None:
        for key in ("steps", "micro_batch_size", "num_microbatches", "log_interval"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(
                f"train.lr={self.lr}, train.min_lr={self.min_lr}: need 0 <= min_lr <= lr, lr > 0"
            )
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("train.warmup_steps, weight_decay and grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    num_stages: int = 2
    """Pipeline stages; one MPI rank each."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Microbatch schedule."""
    partition: list[int] | None = None
    """Initial boundaries over num_layers + 2 layers (parts[0]=0 .. parts[P]=N); null = uniform."""

    def validate(self) -> None:
        if self.num_stages < 1:
            raise ConfigError(f"pipeline.num_stages={self.num_stages} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RuntimeSection:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available (GPU chosen by local rank), else CPU."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank; 1 keeps per-layer CPU timing honest."""
    mpi_launcher: str | None = None
    """Path to mpiexec for local runs; null uses the one in the venv next to Python."""
    timeout_s: float = 3600.0
    """Wall-clock limit for a local launch; the job is killed and reported after it."""
    fail_at_step: int | None = None
    """Fault injection: raise an error on rank ``fail_rank`` at this step (tests abort handling)."""
    fail_rank: int = 0
    """The rank that fails when ``fail_at_step`` is set."""

    def validate(self) -> None:
        if self.threads_per_rank < 1:
            raise ConfigError(f"runtime.threads_per_rank={self.threads_per_rank} must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"runtime.timeout_s={self.timeout_s} must be > 0")


@dataclass(frozen=True, kw_only=True)
class RunlogSection:
    report_interval: int = 5
    """Steps between load reports (per-layer costs gathered to rank 0, run log flushed)."""

    def validate(self) -> None:
        if self.report_interval < 1:
            raise ConfigError(f"runlog.report_interval={self.report_interval} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    runlog: RunlogSection = field(default_factory=RunlogSection)

    @property
    def tokens_per_step(self) -> int:
        return self.train.micro_batch_size * self.train.num_microbatches * self.model.seq_len

    @property
    def run_dir(self) -> Path:
        return Path(self.job.out_dir) / self.job.name

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        num_layers = self.model.num_pipeline_layers
        num_stages = self.pipeline.num_stages
        if num_stages > num_layers:
            raise ConfigError(
                f"pipeline.num_stages({num_stages}) > model.num_layers + 2 ({num_layers}) "
                "(embedding + blocks + head); every stage needs at least one layer: "
                "lower pipeline.num_stages or raise model.num_layers"
            )
        parts = self.pipeline.partition
        if parts is not None:
            if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != num_layers:
                raise ConfigError(
                    f"pipeline.partition={parts} must have num_stages + 1 = {num_stages + 1} "
                    f"entries from 0 to {num_layers} (embedding + {self.model.num_layers} "
                    "blocks + head)"
                )
            if any(b <= a for a, b in zip(parts, parts[1:], strict=False)):
                raise ConfigError(
                    f"pipeline.partition={parts} must be strictly increasing: "
                    "every stage needs at least one layer"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------------
# Strict construction from plain data
# --------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(
            f"{source}: {key}={value!r} has the wrong type; expected {_type_name(tp)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{source}: {key}={value!r} is not valid; choose one of {list(args)}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={value!r} must be a list of {_type_name(args[0])}")
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} must be a mapping")
        return {str(k): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping of {tp.__name__} keys")
        return _build(tp, value, f"{key}.", source)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}={value!r} must be true or false")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}: {key}={value!r} must be a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}={value!r} must be an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}={value!r} must be a string")
        return value
    raise ConfigError(f"{source}: {key}: unsupported field type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise ConfigError(
                f"{source}: unknown key '{prefix}{key}'; valid keys under "
                f"'{prefix.rstrip('.') or '<top>'}' are: {', '.join(valid)}"
            )
        kwargs[key] = _coerce(value, hints[key], prefix + key, source)
    return cls(**kwargs)


def from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Build and validate a :class:`JobConfig`; errors are prefixed with ``source``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    cfg = _build(JobConfig, data, "", source)
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=20")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to raw config data (validated later with the file)."""
    out: dict[str, Any] = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a job YAML into plain data, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: job file not found; pass a YAML file such as jobs/default.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (job:, model:, ...)")
    return data


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Load a job YAML, apply ``section.key=value`` overrides, validate."""
    data = apply_overrides(load_yaml(path), overrides or [])
    return from_dict(data, source=str(path))
