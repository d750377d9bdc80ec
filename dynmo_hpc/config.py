"""Job configuration: a YAML file loaded strictly into frozen, typed dataclasses.

Why strict: a typo in a batch job (``num_microbatch: 8``) that is silently ignored costs a queue
wait plus a wasted allocation. Every unknown key, wrong type and impossible combination is rejected
before any rank starts, with an error naming the key, the file and the fix.

Adding a section: write a frozen keyword-only dataclass with a docstring under each field, add it as
a field of :class:`JobConfig`, and put cross-field checks in its ``validate`` method.
"""

from __future__ import annotations

import dataclasses
import itertools
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
    p2p: Literal["auto", "mpi", "torch"] = "auto"
    """Stage-to-stage transport: mpi4py buffers, torch.distributed (NCCL on GPU, gloo on CPU),
    or auto (torch on CUDA, mpi on CPU)."""
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


BALANCE_ALGORITHMS = ("static", "uniform", "parameters", "optimal", "diffusion")


@dataclass(frozen=True, kw_only=True)
class BalanceSection:
    algorithm: Literal["static", "uniform", "parameters", "optimal", "diffusion"] = "optimal"
    """How rank 0 re-partitions at each load report; ``static`` never moves a layer."""
    interval: int = 5
    """Steps between load reports (per-layer costs gathered to rank 0, run log flushed) and
    balancing decisions."""
    smoothing: float = 0.5
    """Weight of the newest report in the per-layer cost average (1.0: no smoothing)."""
    margin: float = 0.1
    """Enact a new partition only if its predicted gain over the next interval exceeds
    (1 + margin) x the predicted migration time."""
    capacity_bytes: float | None = None
    """Per-stage memory cap (parameters + gradients + optimizer state) for ``optimal``."""
    force_moves: bool = False
    """Testing: at every report, migrate to a different valid partition regardless of gain."""

    def validate(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"balance.interval={self.interval} must be >= 1")
        if not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(f"balance.smoothing={self.smoothing} must be in (0, 1]")
        if self.margin < 0:
            raise ConfigError(f"balance.margin={self.margin} must be >= 0")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"balance.capacity_bytes={self.capacity_bytes} must be > 0 or null")


# --------------------------------------------------------------------------------------------
# Dynamic schemes (one optional sub-section per scheme; absent = off)
# --------------------------------------------------------------------------------------------


def _check_block_layers(key: str, layers: list[int] | None, num_layers: int) -> None:
    """Scheme layer lists name global layer indices of blocks: 1..num_layers."""
    if layers is None:
        return
    if not layers:
        raise ConfigError(f"{key}=[] selects no block; list block indices or use null for all")
    bad = [i for i in layers if not 1 <= i <= num_layers]
    if bad:
        raise ConfigError(
            f"{key} has {bad} outside the blocks 1..{num_layers} (0 is the embedding, "
            f"{num_layers + 1} the head); list global layer indices of blocks"
        )
    if len(set(layers)) != len(layers) or sorted(layers) != layers:
        raise ConfigError(f"{key}={layers} must be strictly increasing, without repeats")


def _num_selected(layers: list[int] | None, default: list[int]) -> int:
    return len(layers) if layers is not None else len(default)


def every_other_block(num_layers: int) -> list[int]:
    """Blocks 2, 4, ...: the Mixture-of-Depths default (Raposo et al. route every other block)."""
    return list(range(2, num_layers + 1, 2)) or [1]


@dataclass(frozen=True, kw_only=True)
class MoESection:
    layers: list[int] | None = None
    """Global layer indices (1..num_layers) of blocks whose feed-forward is a mixture of
    experts; null = every block."""
    num_experts: int = 4
    """Experts per MoE block (E)."""
    top_k: int = 2
    """Experts each token is routed to (k <= E)."""
    capacity_factor: float = 1.25
    """Expert capacity = ceil(capacity_factor * top_k * tokens / num_experts), where tokens is
    the number of tokens the block sees in one microbatch."""
    overflow: Literal["drop", "reroute"] = "drop"
    """Assignments over an expert's capacity: drop (the residual carries the token) or reroute to
    the token's next-ranked expert that still has room (dropped only when none has)."""
    d_ff_expert: int | None = None
    """Hidden width of each expert; null = the block's dense width (model.d_ff / layer_d_ff)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss E * sum_e f_e * P_e added per MoE block."""

    def validate(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"schemes.moe.top_k={self.top_k}, num_experts={self.num_experts}: "
                "need 1 <= top_k <= num_experts"
            )
        if self.capacity_factor <= 0:
            raise ConfigError(
                f"schemes.moe.capacity_factor={self.capacity_factor} must be > 0 "
                "(1.0 = exactly an even share per expert)"
            )
        if self.d_ff_expert is not None and self.d_ff_expert < 1:
            raise ConfigError(f"schemes.moe.d_ff_expert={self.d_ff_expert} must be >= 1 or null")
        if self.aux_loss_weight < 0:
            raise ConfigError(f"schemes.moe.aux_loss_weight={self.aux_loss_weight} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class PruningSection:
    final_sparsity: float = 0.75
    """Fraction of the prunable structures (feed-forward neurons, attention heads) removed by
    end_step (s_f in Zhu & Gupta 2017)."""
    initial_sparsity: float = 0.0
    """Sparsity of the first pruning step at start_step (s_i)."""
    start_step: int = 0
    """First optimizer step after which pruning runs (t_0)."""
    end_step: int = 40
    """Step at which the final sparsity is reached (t_0 + n * interval_steps)."""
    interval_steps: int = 5
    """Steps between pruning events (delta t)."""
    layers: list[int] | None = None
    """Blocks that may be pruned (global indices 1..num_layers); null = every block."""
    prune_heads: bool = True
    """Prune whole attention heads (global ranking of heads by weight magnitude)."""
    prune_neurons: bool = True
    """Prune whole feed-forward neurons, experts' included (global ranking of neurons)."""
    min_heads: int = 1
    """Heads every pruned block keeps."""
    min_neurons: int = 1
    """Neurons every feed-forward (or expert) keeps."""

    def validate(self) -> None:
        if not 0.0 <= self.initial_sparsity <= self.final_sparsity < 1.0:
            raise ConfigError(
                f"schemes.pruning.initial_sparsity={self.initial_sparsity}, "
                f"final_sparsity={self.final_sparsity}: need 0 <= initial <= final < 1"
            )
        if self.start_step < 0 or self.interval_steps < 1 or self.end_step < self.start_step:
            raise ConfigError(
                f"schemes.pruning.start_step={self.start_step}, end_step={self.end_step}, "
                f"interval_steps={self.interval_steps}: need 0 <= start_step <= end_step and "
                "interval_steps >= 1"
            )
        if (self.end_step - self.start_step) % self.interval_steps:
            raise ConfigError(
                f"schemes.pruning: end_step({self.end_step}) - start_step({self.start_step}) "
                f"is not a multiple of interval_steps({self.interval_steps}); the schedule "
                "reaches final_sparsity at start_step + n * interval_steps"
            )
        if not (self.prune_heads or self.prune_neurons):
            raise ConfigError(
                "schemes.pruning: prune_heads and prune_neurons are both false; enable one "
                "or remove the pruning section"
            )
        if self.min_heads < 1 or self.min_neurons < 1:
            raise ConfigError("schemes.pruning.min_heads and min_neurons must be >= 1")


@dataclass(frozen=True, kw_only=True)
class FreezingSection:
    threshold: float = 0.05
    """A layer has converged when its gradient norm changed by less than this fraction between
    two checks (AutoFreeze's criterion)."""
    interval_steps: int = 5
    """Steps between convergence checks."""
    start_step: int = 10
    """No layer freezes before this many steps have run."""
    max_layers_per_check: int = 1
    """At most this many more layers join the frozen prefix per check."""
    max_frozen_layers: int | None = None
    """Cap on the frozen prefix length; null = every layer but the head."""

    def validate(self) -> None:
        if self.threshold < 0 or self.interval_steps < 1 or self.start_step < 0:
            raise ConfigError(
                f"schemes.freezing.threshold={self.threshold}, interval_steps="
                f"{self.interval_steps}, start_step={self.start_step}: need threshold >= 0, "
                "interval_steps >= 1, start_step >= 0"
            )
        if self.max_layers_per_check < 1:
            raise ConfigError(
                f"schemes.freezing.max_layers_per_check={self.max_layers_per_check} must be >= 1"
            )
        if self.max_frozen_layers is not None and self.max_frozen_layers < 0:
            raise ConfigError(
                f"schemes.freezing.max_frozen_layers={self.max_frozen_layers} must be >= 0"
            )


@dataclass(frozen=True, kw_only=True)
class SparseAttentionSection:
    block_size: int = 16
    """Tokens per attention block; must divide model.seq_len."""
    density: float = 0.5
    """Fraction of the causal key blocks each query block keeps (its own block always counts)."""
    layer_density: list[float] | None = None
    """One density per selected block (per entry of layers, or per block when layers is null);
    overrides density."""
    layers: list[int] | None = None
    """Blocks with sparse attention (global indices 1..num_layers); null = every block."""
    drift_factor: float = 1.0
    """Every layer's density is multiplied by a factor moving linearly from 1 at
    drift_start_step to drift_factor at drift_end_step (1 = no drift)."""
    drift_start_step: int = 0
    """Step at which the density starts to drift."""
    drift_end_step: int = 0
    """Step at which the drift reaches drift_factor."""

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"schemes.sparse_attention.block_size={self.block_size} must be >= 1")
        densities = [self.density, *(self.layer_density or [])]
        if any(not 0.0 < d <= 1.0 for d in densities):
            raise ConfigError(f"schemes.sparse_attention densities {densities} must be in (0, 1]")
        if self.drift_factor <= 0 or not 0 <= self.drift_start_step <= self.drift_end_step:
            raise ConfigError(
                f"schemes.sparse_attention.drift_factor={self.drift_factor}, drift_start_step="
                f"{self.drift_start_step}, drift_end_step={self.drift_end_step}: need "
                "drift_factor > 0 and 0 <= drift_start_step <= drift_end_step"
            )


@dataclass(frozen=True, kw_only=True)
class EarlyExitSection:
    layers: list[int] | None = None
    """Blocks with an exit head (global indices 1..num_layers); null = every block but the last."""
    threshold: float = 0.9
    """A token exits after an exit block when the exit head's top softmax probability is at least
    this (CALM's softmax-response confidence)."""
    start_step: int = 0
    """Tokens start to exit once this many steps have run (exit heads train from step 0)."""
    exit_loss_weight: float = 0.1
    """Weight of each exit head's cross-entropy over the tokens that reach it."""

    def validate(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"schemes.early_exit.threshold={self.threshold} must be in [0, 1]")
        if self.start_step < 0 or self.exit_loss_weight < 0:
            raise ConfigError("schemes.early_exit.start_step and exit_loss_weight must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MoDSection:
    layers: list[int] | None = None
    """Blocks with a Mixture-of-Depths router (global indices 1..num_layers); null = every
    other block (2, 4, ...)."""
    capacity: float = 0.125
    """Fraction of each sequence's tokens a routed block processes (the rest skip it)."""
    layer_capacity: list[float] | None = None
    """One capacity per selected block (per entry of layers, or per block of the default);
    overrides capacity."""

    def validate(self) -> None:
        capacities = [self.capacity, *(self.layer_capacity or [])]
        if any(not 0.0 < c <= 1.0 for c in capacities):
            raise ConfigError(f"schemes.mod capacities {capacities} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class SchemesSection:
    moe: MoESection | None = None
    """Mixture of Experts feed-forward; absent = off."""
    pruning: PruningSection | None = None
    """Gradual structured magnitude pruning; absent = off."""
    freezing: FreezingSection | None = None
    """Progressive front-first layer freezing; absent = off."""
    sparse_attention: SparseAttentionSection | None = None
    """Dynamic block-sparse causal attention; absent = off."""
    early_exit: EarlyExitSection | None = None
    """Per-token early exit with exit heads; absent = off."""
    mod: MoDSection | None = None
    """Mixture of Depths token routing; absent = off."""

    @property
    def enabled(self) -> list[str]:
        """Names of the schemes switched on, in declaration order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def validate(self) -> None:
        for name in self.enabled:
            getattr(self, name).validate()
        if self.early_exit is not None:
            for other in ("mod", "sparse_attention"):
                if getattr(self, other) is not None:
                    raise ConfigError(
                        f"schemes.early_exit and schemes.{other} are both on; early-exit blocks "
                        "attend with a ragged set of queries, which neither composes with; "
                        "enable one of them"
                    )

    def validate_for(self, model: ModelSection) -> None:
        """Checks that need the model: layer indices, per-layer list lengths, block sizes."""
        n = model.num_layers
        blocks = list(range(1, n + 1))
        if self.moe is not None:
            _check_block_layers("schemes.moe.layers", self.moe.layers, n)
        if self.pruning is not None:
            _check_block_layers("schemes.pruning.layers", self.pruning.layers, n)
            if self.pruning.min_heads > model.num_heads:
                raise ConfigError(
                    f"schemes.pruning.min_heads({self.pruning.min_heads}) > model.num_heads"
                    f"({model.num_heads}); lower min_heads"
                )
        max_frozen = self.freezing.max_frozen_layers if self.freezing is not None else None
        if max_frozen is not None and max_frozen > n + 1:
            raise ConfigError(
                f"schemes.freezing.max_frozen_layers({max_frozen}) > "
                f"model.num_layers + 1 ({n + 1}); the head never freezes"
            )
        sa = self.sparse_attention
        if sa is not None:
            _check_block_layers("schemes.sparse_attention.layers", sa.layers, n)
            if model.seq_len % sa.block_size:
                raise ConfigError(
                    f"model.seq_len({model.seq_len}) % schemes.sparse_attention.block_size"
                    f"({sa.block_size}) != 0; choose a block size dividing seq_len"
                )
            count = _num_selected(sa.layers, blocks)
            if sa.layer_density is not None and len(sa.layer_density) != count:
                raise ConfigError(
                    f"schemes.sparse_attention.layer_density has {len(sa.layer_density)} "
                    f"entries for {count} selected blocks; give one per selected block"
                )
        if self.early_exit is not None:
            _check_block_layers("schemes.early_exit.layers", self.early_exit.layers, n)
        if self.mod is not None:
            _check_block_layers("schemes.mod.layers", self.mod.layers, n)
            count = _num_selected(self.mod.layers, every_other_block(n))
            if self.mod.layer_capacity is not None and len(self.mod.layer_capacity) != count:
                raise ConfigError(
                    f"schemes.mod.layer_capacity has {len(self.mod.layer_capacity)} entries "
                    f"for {count} selected blocks; give one per selected block"
                )
            if sa is not None:
                both = set(self.mod.layers or every_other_block(n)) & set(sa.layers or blocks)
                if both:
                    raise ConfigError(
                        f"blocks {sorted(both)} are in both schemes.mod.layers and "
                        "schemes.sparse_attention.layers; routed blocks attend densely over "
                        "their selected tokens: make the two layer lists disjoint"
                    )


@dataclass(frozen=True, kw_only=True)
class SlurmSection:
    """How the job is submitted to SLURM (``dynmo-hpc sbatch`` / ``dynmo-hpc submit``).

    The fields mirror :func:`dynmo_hpc.slurm.sbatch.render_sbatch`'s job parameters, so one job
    file renders the same allocation through the sbatch template and through submitit. Local runs
    (``dynmo-hpc run``) ignore the section.
    """

    nodes: int | None = None
    """``--nodes``; null = pipeline.num_stages (one stage per node)."""
    tasks_per_node: int = 1
    """``--ntasks-per-node``: MPI ranks per node; nodes * tasks_per_node >= num_stages."""
    gpus_per_node: int = 0
    """``--gpus-per-node``; 0 leaves it out (CPU nodes)."""
    cpus_per_task: int = 1
    """``--cpus-per-task``; raise it with runtime.threads_per_rank."""
    time_min: int = 30
    """``--time`` in minutes; the job is killed after it."""
    partition: str | None = None
    """``--partition``; null = the cluster's default partition."""
    account: str | None = None
    """``--account`` to charge; null = the user's default."""
    qos: str | None = None
    """``--qos``; null = the default quality of service."""
    mem_gb: float | None = None
    """``--mem`` per node in GB; null = the partition's default."""
    signal_delay_s: int = 120
    """SIGUSR2 reaches the job manager this many seconds before the time limit (checkpoint)."""
    venv: str | None = None
    """Virtual environment the job activates; null = the one running at submit time
    (``sys.prefix``), or none when that is not a venv."""
    conda_env: str | None = None
    """Conda environment the job activates instead of a venv (not together with venv)."""
    modules: list[str] = field(default_factory=list)
    """Environment modules to ``module load``, in order, before activation (e.g. an MPI, CUDA)."""
    launcher: Literal["auto", "srun", "mpirun"] = "auto"
    """How the manager starts the ranks: ``srun --mpi=pmix``, the venv's ``mpirun``; auto = srun."""
    loopback_only: bool = False
    """Pin Open MPI to TCP over ``lo``: true only where all nodes share one host (test clusters)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` flags, verbatim, e.g. ``[--exclusive]``."""

    def num_nodes(self, num_stages: int) -> int:
        """The node count to ask for: ``nodes``, or one node per pipeline stage."""
        return num_stages if self.nodes is None else self.nodes

    def validate(self) -> None:
        # The sbatch renderer owns the rules for impossible values (signal after the time
        # limit, venv and conda together, unsafe #SBATCH text); reuse them so both paths agree.
        from .slurm.sbatch import SbatchOptionError, validate_sbatch_options

        try:
            validate_sbatch_options(
                {
                    "job_name": "validate",
                    "config_path": "validate.yaml",
                    "output_dir": "validate",
                    "nodes": 1 if self.nodes is None else self.nodes,
                    "tasks_per_node": self.tasks_per_node,
                    "gpus_per_node": self.gpus_per_node,
                    "cpus_per_task": self.cpus_per_task,
                    "time_min": self.time_min,
                    "partition": self.partition,
                    "account": self.account,
                    "qos": self.qos,
                    "mem_gb": self.mem_gb,
                    "signal_delay_s": self.signal_delay_s,
                    "venv": self.venv,
                    "conda_env": self.conda_env,
                    "modules": self.modules,
                    "launcher": self.launcher,
                    "mpi_loopback_only": self.loopback_only,
                    "extra_sbatch": self.extra_sbatch,
                }
            )
        except SbatchOptionError as exc:
            problems = [
                "slurm." + line.strip()[2:]
                for line in str(exc).splitlines()
                if line.strip().startswith("- ")
            ]
            raise ConfigError(
                "; ".join(problems or [str(exc)])
                + "; HINT: fix it under slurm: in the job file or with --set slurm.KEY=VALUE"
            ) from None

    def validate_for(self, pipeline: PipelineSection) -> None:
        """One MPI rank per stage: the allocation must hold a task slot for every stage."""
        num_nodes = self.num_nodes(pipeline.num_stages)
        slots = num_nodes * self.tasks_per_node
        if slots < pipeline.num_stages:
            raise ConfigError(
                f"slurm.nodes({num_nodes}) * slurm.tasks_per_node({self.tasks_per_node}) = "
                f"{slots} < pipeline.num_stages({pipeline.num_stages}): every stage needs a "
                "task slot; HINT: raise slurm.nodes or slurm.tasks_per_node, or set "
                "slurm.nodes: null (one node per stage)"
            )


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    balance: BalanceSection = field(default_factory=BalanceSection)
    schemes: SchemesSection = field(default_factory=SchemesSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    """SLURM submission settings; local runs ignore them."""

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
        self.schemes.validate_for(self.model)
        self.slurm.validate_for(self.pipeline)
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
            if any(b <= a for a, b in itertools.pairwise(parts)):
                raise ConfigError(
                    f"pipeline.partition={parts} must be strictly increasing: "
                    "every stage needs at least one layer"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return str(yaml.safe_dump(self.to_dict(), sort_keys=False))


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
        if len(errors) == 1:  # ``X | None``: X's own message names the bad key inside it
            raise ConfigError(errors[0])
        raise ConfigError(
            f"{source}: {key}={value!r} has the wrong type; expected {_type_name(tp)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}={value!r} is not valid; choose one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={value!r} must be a list of {_type_name(args[0])}")
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} must be a mapping")
        return {str(k): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
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
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any Python float literal.
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{source}: {key}={value!r} must be a number") from None
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
    cfg: JobConfig = _build(JobConfig, data, "", source)
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
