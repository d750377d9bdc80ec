"""The job's core sections: job, model, data, train, pipeline, runtime, checkpoint, balance.

Each is a frozen keyword-only dataclass with a docstring under every field; ``validate`` holds
the section's own checks (cross-section checks live in :class:`~dynmo_hpc.config.job.JobConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from dynmo_hpc.balance.registry import ALGORITHMS, STATIC, check_balance_settings
from dynmo_hpc.config.bounds import (
    MAX_BATCH,
    MAX_SEED,
    MAX_STEPS,
    MAX_THREADS_PER_RANK,
    MAX_TIMEOUT_S,
    MAX_WIDTH,
    at_most,
    in_range,
    printable,
)
from dynmo_hpc.config.data_source import TokenizerSection
from dynmo_hpc.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class JobSection:
    name: str = "default"
    """Job name; the run directory is ``<out_dir>/<name>``."""
    seed: int = 1337
    """Seed for weights (per global layer index) and for batches (per step)."""
    out_dir: str = "runs"
    """Directory under which ``<name>/`` holds the config, checkpoint and run log."""

    def validate(self) -> None:
        if (
            not self.name
            or self.name.startswith(".")
            or any(c in self.name for c in "/\\ ")
            or not self.name.isprintable()
        ):
            raise ConfigError(
                f"job.name={self.name!r} must be a non-empty name without '/', '\\', spaces or "
                "control characters, not starting with '.'; HINT: the run directory is "
                "<out_dir>/<name>, so '..' or '.' would write outside it"
            )
        in_range(
            "job.seed",
            self.seed,
            0,
            MAX_SEED,
            "numpy and torch take unsigned 32-bit seeds; pick one in that range, e.g. 1337",
        )
        printable("job.out_dir", self.out_dir)
        if not self.out_dir.strip():
            raise ConfigError("job.out_dir='' is empty; HINT: use runs (the default) or a path")


ARCH_SCHEMES: dict[str, frozenset[str] | None] = {
    "gpt2": None,
    "llama": None,
}
"""Model families by ``model.arch`` name, each with the schemes it supports (None: every
scheme). A family registers itself in :mod:`dynmo_hpc.model.families`, which checks its name
is here; a scheme missing from a family's set is refused by the config, never run silently."""

GPT2_ACTIVATIONS = ("gelu", "gelu_tanh")
"""gpt2's MLP activations: exact GELU, or its tanh approximation (Hugging Face's gelu_new)."""

MAX_BLOCKS = 100_000
"""More blocks than any model trains: a larger value is a typo, refused before it costs memory."""


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    num_blocks: int = 8
    """Transformer blocks. The pipeline places num_blocks + 2 layers: embedding, blocks, head."""
    d_model: int = 128
    """Residual stream width."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    d_ff: int = 512
    """Feed-forward hidden width (4 * d_model in GPT-2)."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab_size: int = 256
    """Token ids the model embeds; when the job does not set it, the data's vocabulary
    (256 for byte-level text, ``meta.json``'s for a prepared directory)."""
    layer_d_ff: list[int] | None = None
    """Optional per-block feed-forward widths (length num_blocks) to build an imbalanced model."""
    arch: str = "gpt2"
    """Model family (:data:`ARCH_SCHEMES`): ``gpt2`` (LayerNorm, learned positions, GELU MLP,
    biased attention) or ``llama`` (RMSNorm, rotary positions, SwiGLU MLP, grouped-query
    attention, no biases)."""
    num_kv_heads: int | None = None
    """llama: key/value heads (grouped-query attention), dividing num_heads; null = num_heads."""
    norm_eps: float = 1e-5
    """Epsilon of every normalisation (LayerNorm for gpt2, RMSNorm for llama)."""
    rope_theta: float = 10000.0
    """llama: base of the rotary position embedding's frequencies."""
    activation: str = "gelu"
    """gpt2: the MLP's GELU, ``gelu`` (exact) or ``gelu_tanh`` (Hugging Face's ``gelu_new``)."""
    max_positions: int | None = None
    """gpt2: rows of the learned position table (>= seq_len); null = seq_len."""
    init_from: str | None = None
    """A Hugging Face model directory (config.json and *.safetensors) whose weights replace the
    initial weights; its config.json decides the model keys above (see docs/models.md)."""
    tie_embeddings: bool = False
    """Tie the LM head's weight to the token embedding (one parameter, as Hugging Face's
    ``tie_word_embeddings``): the head's copy starts equal to the embedding's and both copies
    get the sum of their gradients every step, so they stay bitwise equal. Set from config.json
    with ``init_from``."""

    @property
    def num_layers(self) -> int:
        """Embedding + blocks + head: the units the partitioner places."""
        return self.num_blocks + 2

    def block_d_ff(self, layer: int) -> int:
        """Feed-forward width of the block at global layer index ``layer`` (1..num_blocks)."""
        return self.layer_d_ff[layer - 1] if self.layer_d_ff is not None else self.d_ff

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when unset."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def num_positions(self) -> int:
        """Rows of gpt2's learned position table."""
        return self.max_positions if self.max_positions is not None else self.seq_len

    def validate(self) -> None:
        for key in ("num_blocks", "d_model", "num_heads", "d_ff", "seq_len", "vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        self._validate_arch()
        if self.num_blocks > MAX_BLOCKS:
            raise ConfigError(
                f"model.num_blocks={self.num_blocks} > {MAX_BLOCKS}; HINT: a typo? GPT-3 has 96"
            )
        for key in ("d_model", "d_ff", "seq_len", "vocab_size"):
            at_most(
                f"model.{key}",
                getattr(self, key),
                MAX_WIDTH,
                "a typo? GPT-3's widest matrix is 49152",
            )
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
            if len(self.layer_d_ff) != self.num_blocks:
                raise ConfigError(
                    f"model.layer_d_ff has {len(self.layer_d_ff)} entries but "
                    f"model.num_blocks={self.num_blocks}; give one width per block"
                )
            if any(not 1 <= w <= MAX_WIDTH for w in self.layer_d_ff):
                raise ConfigError(
                    f"model.layer_d_ff entries must be in [1, {MAX_WIDTH}]; HINT: give each "
                    "block's feed-forward width, e.g. 512"
                )

    def _validate_arch(self) -> None:
        if self.arch not in ARCH_SCHEMES:
            raise ConfigError(
                f"model.arch={self.arch!r} is not a model family; valid: {', '.join(ARCH_SCHEMES)}"
            )
        if self.activation not in GPT2_ACTIVATIONS:
            raise ConfigError(
                f"model.activation={self.activation!r}; valid: {', '.join(GPT2_ACTIVATIONS)}"
            )
        if not (0.0 < self.norm_eps < 1.0) or not (self.rope_theta > 0.0):
            raise ConfigError(
                f"model.norm_eps={self.norm_eps} must be in (0, 1) and model.rope_theta="
                f"{self.rope_theta} > 0; HINT: 1e-5 and 10000 are the usual values"
            )
        if self.arch != "llama" and self.num_kv_heads is not None:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} needs model.arch: llama (gpt2 has one "
                "key/value head per query head); HINT: remove it or set model.arch: llama"
            )
        if self.arch != "gpt2" and (self.activation != "gelu" or self.max_positions is not None):
            raise ConfigError(
                "model.activation and model.max_positions are gpt2 keys; llama uses SwiGLU and "
                "rotary positions; HINT: remove them"
            )
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ConfigError(
                f"model.num_heads({self.num_heads}) % model.num_kv_heads({kv}) != 0; HINT: "
                "each key/value head serves a whole group of query heads"
            )
        if self.arch == "llama" and (self.d_model // self.num_heads) % 2:
            raise ConfigError(
                f"model.d_model({self.d_model}) / model.num_heads({self.num_heads}) is odd; "
                "rotary embeddings rotate pairs of dimensions; HINT: use an even head size"
            )
        if self.num_positions < self.seq_len:
            raise ConfigError(
                f"model.max_positions({self.max_positions}) < model.seq_len({self.seq_len}); "
                "HINT: raise max_positions or remove it"
            )
        printable("model.init_from", self.init_from)

    def layer_params(self) -> list[int]:
        """Parameters of each layer at initialization (embedding, blocks, head), dense blocks.

        Why: a lower bound for memory checks made before any rank builds the model
        (``balance.capacity_bytes``); MoE experts only add to it.
        """
        d = self.d_model
        if self.arch == "llama":
            kv_width = self.kv_heads * (d // self.num_heads)
            attention = 2 * d * d + 2 * d * kv_width  # q, o (d x d) and k, v (kv_width x d)
            blocks = [
                attention + 2 * d + 3 * d * self.block_d_ff(i)  # two RMSNorms, gate/up/down
                for i in range(1, self.num_blocks + 1)
            ]
            return [self.vocab_size * d, *blocks, d * self.vocab_size + d]
        embedding = (self.vocab_size + self.num_positions) * d
        attention = 4 * d * d + 4 * d  # c_attn (3d x d + 3d) and c_proj (d x d + d)
        norms = 4 * d  # two LayerNorms, weight and bias
        blocks = [
            attention + norms + 2 * d * self.block_d_ff(i) + self.block_d_ff(i) + d
            for i in range(1, self.num_blocks + 1)
        ]
        head = d * self.vocab_size + 2 * d  # lm_head (no bias) and ln_f
        return [embedding, *blocks, head]


@dataclass(frozen=True, kw_only=True)
class DataSection:
    path: str | None = None
    """UTF-8 text file to train on (null: the English docs that ship with CPython), a flat
    ``uint16`` ``.bin`` token file, or a directory written by ``dynmo-hpc prepare-data``."""
    val_fraction: float = 0.1
    """Tail fraction of the text held out for validation (a prepared directory has its own)."""
    tokenizer: TokenizerSection | None = None
    """Tokenize the text of ``path`` (prepared once, before the ranks start, into
    ``cache_dir``) instead of training on its bytes; null: byte-level."""
    cache_dir: str | None = None
    """Where ``tokenizer`` keeps prepared data; null: ``<job.out_dir>/.data_cache``."""

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} must be in [0, 1); HINT: 0.1 holds out "
                "the last 10 % of the text"
            )
        printable("data.path", self.path)
        printable("data.cache_dir", self.cache_dir)
        try:
            missing = self.path is not None and not Path(self.path).exists()
            is_dir = self.path is not None and Path(self.path).is_dir()
        except OSError as exc:  # a name too long for the file system, a permission error
            raise ConfigError(
                f"data.path={self.path!r} cannot be checked ({exc.strerror}); HINT: give a UTF-8 "
                "text file or null"
            ) from None
        if missing:
            raise ConfigError(
                f"data.path={self.path!r} is not a file or directory; give a UTF-8 text file, a "
                ".bin token file, a prepare-data directory, or null"
            )
        if self.tokenizer is not None:
            if is_dir:
                raise ConfigError(
                    f"data.path={self.path!r} is a prepared directory and data.tokenizer is set; "
                    "HINT: a prepared directory has its tokenizer: drop data.tokenizer"
                )
            self.tokenizer.validate()


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
    steady_state_step: int | None = None
    """First step of the steady state: the step from which the job's schemes act at full
    strength. ``dynmo-hpc bench`` reports the ramp (steps before it) and the steady state
    (this step on) apart. None: half the run (``steps // 2``). Training does not read it."""

    eval_interval: int = 0
    """Steps between validation passes (and one after the last step); 0: none. Each scores the
    same ``eval_windows`` validation windows, forward only, into the run log's ``eval`` table."""
    eval_windows: int = 32
    """Validation windows (sequences) per pass: a multiple of ``micro_batch_size``."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: each layer's forward under bf16 autocast (its backward follows), with fp32
    weights, gradients, AdamW state and checkpoints; ``fp32``: everything fp32."""

    def steady_from_step(self) -> int:
        """:attr:`steady_state_step`, or half the run when it is not set."""
        return self.steps // 2 if self.steady_state_step is None else self.steady_state_step

    def validate(self) -> None:
        for key in ("steps", "micro_batch_size", "num_microbatches", "log_interval"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        steady = self.steady_state_step
        if steady is not None and not 0 <= steady < self.steps:
            raise ConfigError(
                f"train.steady_state_step={steady} is not a step of the run (0..{self.steps - 1}); "
                "HINT: set it to the step from which the schemes act at full strength, or null "
                "for half the run"
            )
        at_most("train.steps", self.steps, MAX_STEPS, "a typo? that is years of training")
        if self.eval_interval < 0 or self.eval_windows < 1:
            raise ConfigError(
                f"train.eval_interval={self.eval_interval}, train.eval_windows="
                f"{self.eval_windows}: need eval_interval >= 0 (0: no validation) and "
                "eval_windows >= 1"
            )
        if self.eval_interval and self.eval_windows % self.micro_batch_size:
            raise ConfigError(
                f"train.eval_windows={self.eval_windows} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; HINT: validation runs in "
                f"microbatches, e.g. eval_windows={4 * self.micro_batch_size}"
            )
        for key in ("micro_batch_size", "num_microbatches"):
            at_most(f"train.{key}", getattr(self, key), MAX_BATCH, "a typo? try 8")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(
                f"train.lr={self.lr}, train.min_lr={self.min_lr}: need 0 <= min_lr <= lr, lr > 0"
            )
        at_most("train.lr", self.lr, 1.0, "AdamW diverges far below lr=1; try 1e-3")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError(
                f"train.warmup_steps={self.warmup_steps}, weight_decay={self.weight_decay}, "
                f"grad_clip={self.grad_clip}: all must be >= 0"
            )
        at_most("train.warmup_steps", self.warmup_steps, MAX_STEPS, "a typo? try 5")
        at_most(
            "train.weight_decay",
            self.weight_decay,
            1.0,
            "decoupled decay shrinks weights by lr * weight_decay per step; try 0.1",
        )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(
                f"train.beta1={self.beta1}, train.beta2={self.beta2} must be in [0, 1); "
                "HINT: AdamW's usual values are 0.9 and 0.95"
            )


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    num_stages: int = 2
    """Pipeline stages per replica; one MPI rank each."""
    replicas: int = 1
    """Data-parallel replicas of the pipeline, all on one partition: the job runs on
    ``replicas * num_stages`` ranks, and the replicas split each step's microbatches."""
    schedule: Literal["1f1b", "1f1b-slack", "gpipe"] = "1f1b"
    """Microbatch schedule: ``1f1b``; ``1f1b-slack`` (one more warmup forward on every stage
    but the last, so a neighbour's delay is absorbed instead of passed on; one more microbatch
    of activations held); ``gpipe``."""
    grad_bucket_mb: float = 25.0
    """Largest flat buffer (MiB, whole layers) one gradient all-reduce between replicas
    carries; smaller buckets start earlier in the backward (more overlap), more of them cost
    more calls."""
    partition: list[int] | None = None
    """Initial boundaries over num_blocks + 2 layers (parts[0]=0 .. parts[P]=N); null = uniform."""
    recompute: Literal["none", "block"] = "none"
    """``block``: keep only each transformer block's input for the backward and recompute the
    rest there (activation checkpointing; same numbers, less memory, about one more forward)."""

    def validate(self) -> None:
        if self.num_stages < 1:
            raise ConfigError(f"pipeline.num_stages={self.num_stages} must be >= 1")
        if self.replicas < 1:
            raise ConfigError(
                f"pipeline.replicas={self.replicas} must be >= 1; HINT: 1 runs one pipeline"
            )
        at_most("pipeline.replicas", self.replicas, MAX_BATCH, "a typo? try 2")
        if not self.grad_bucket_mb > 0:
            raise ConfigError(
                f"pipeline.grad_bucket_mb={self.grad_bucket_mb} must be > 0; HINT: 25 is the "
                "default"
            )
        at_most("pipeline.grad_bucket_mb", self.grad_bucket_mb, 4096.0, "a typo? try 25")

    @property
    def world_size(self) -> int:
        """MPI ranks the job runs on: ``replicas * num_stages``."""
        return self.replicas * self.num_stages


@dataclass(frozen=True, kw_only=True)
class RuntimeSection:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available (GPU chosen by local rank), else CPU."""
    p2p: Literal["auto", "mpi", "torch"] = "auto"
    """Stage-to-stage transport: mpi4py buffers, torch.distributed (NCCL on GPU, gloo on CPU),
    or auto (torch on CUDA, mpi on CPU)."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank; 1 keeps per-layer CPU timing honest."""
    wait_mode: Literal["auto", "yield", "sleep"] = "auto"
    """How a stage waits for its neighbour: yield its core for the first few milliseconds
    (``yield``), sleep between polls at once (``sleep``), or yield only when every rank on the host
    has a core of its own (``auto``; :mod:`dynmo_hpc.pipeline.waiting`)."""
    mpi_launcher: str | None = None
    """Path to mpiexec for local runs; null uses the one in the venv next to Python."""
    timeout_s: float = 3600.0
    """Wall-clock limit for a local launch; the job is killed and reported after it."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "fail_at_step": "fault.inject_step (with fault.inject_action=raise)",
        "fail_rank": "fault.inject_rank",
        "fail_mode": "fault.inject_action (raise; kill_job for sigkill_job; signal with "
        "fault.inject_signal=SIGTERM for sigterm)",
    }
    """Keys that fault injection replaced: the loader names the new key for each."""

    def validate(self) -> None:
        if self.threads_per_rank < 1:
            raise ConfigError(f"runtime.threads_per_rank={self.threads_per_rank} must be >= 1")
        at_most(
            "runtime.threads_per_rank",
            self.threads_per_rank,
            MAX_THREADS_PER_RANK,
            "no node has that many cores; use the cores per rank, e.g. 4",
        )
        if self.timeout_s <= 0:
            raise ConfigError(f"runtime.timeout_s={self.timeout_s} must be > 0")
        at_most("runtime.timeout_s", self.timeout_s, MAX_TIMEOUT_S, "a year at most; in seconds")
        printable("runtime.mpi_launcher", self.mpi_launcher)
        if self.mpi_launcher is not None and not self.mpi_launcher.strip():
            raise ConfigError(
                "runtime.mpi_launcher='' is empty; HINT: give the path of mpiexec, or null for "
                "the venv's"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """When checkpoints are written under ``<run dir>/checkpoint/step_<n>/``.

    A checkpoint holds every layer (weights, AdamW state, scheme state) and the run's state
    (step, partition, balancer), keyed by global layer, so ``dynmo-hpc run --resume`` continues
    exactly, on the same or another number of stages.
    """

    every_steps: int = 20
    """Write one every this many steps (at a step boundary); 0 = never by step count."""
    every_minutes: float = 0.0
    """Also write one when this many minutes passed since the last (rank 0's clock); 0 = off."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted only after a newer one is complete."""
    at_end: bool = True
    """Write one after the last step (a stop on SIGTERM/SIGUSR2 always writes one)."""

    def validate(self) -> None:
        at_most("checkpoint.every_steps", self.every_steps, MAX_STEPS, "a typo? try 20")
        at_most("checkpoint.keep", self.keep, 1000, "each kept checkpoint is a full copy; try 2")
        if self.every_steps < 0:
            raise ConfigError(
                f"checkpoint.every_steps={self.every_steps} must be >= 0 (0 turns it off)"
            )
        if not (math.isfinite(self.every_minutes) and self.every_minutes >= 0):
            raise ConfigError(
                f"checkpoint.every_minutes={self.every_minutes} must be a finite number >= 0 "
                "(0 turns it off)"
            )
        if self.keep < 1:
            raise ConfigError(
                f"checkpoint.keep={self.keep} must be >= 1; HINT: 2 or more keeps a fallback "
                "if the newest checkpoint is damaged"
            )


@dataclass(frozen=True, kw_only=True)
class BalanceSection:
    algorithm: str = "optimal"
    """How rank 0 re-partitions at each load report: ``static`` (never moves a layer) or a name
    in :data:`dynmo_hpc.balance.ALGORITHMS`, which also holds each one's settings check.
    ``uniform``, ``parameters`` and ``optimal`` propose their whole partition at once;
    ``diffusion`` proposes one phase of neighbour re-splits per report (pairs (0,1), (2,3), ...
    or (1,2), (3,4), ..., alternating), so a layer moves at most one stage per migration and
    successive reports walk to diffusion's fixed point. Each proposal is enacted only if it pays
    for its migration."""
    interval: int = 5
    """Steps between load reports (per-layer costs gathered to rank 0, run log flushed) and
    balancing decisions."""
    smoothing: float = 0.5
    """Weight of the newest report in the per-layer cost average (1.0: no smoothing)."""
    margin: float = 0.1
    """Enact a new partition only if its predicted gain until the next report (or the end of
    training, if sooner) exceeds (1 + margin) x the predicted migration time."""
    capacity_bytes: float | None = None
    """Per-stage memory cap (parameters + gradients + optimizer state) for ``optimal`` and
    ``diffusion`` (``optimal`` also repairs a partition over it; ``diffusion`` never crosses it)."""
    force_moves: bool = False
    """Testing: at every report, migrate to a different valid partition regardless of gain."""
    ab_period_steps: int = 0
    """Benchmarking (A/B within one run): 0 off. ``k > 0``: the partition alternates every ``k``
    steps between the static split (arm A, the job's initial partition: ``pipeline.partition``
    or uniform) and the algorithm's latest plan (arm B), starting with A; the algorithm plans
    from the measured costs in both arms as if it ran alone (:mod:`dynmo_hpc.train.ab_arms`).
    Each step's arm is in the run log. A multiple of ``interval`` (the switch migrates at the
    load report that ends a block); needs a rebalancing algorithm and no elastic packing."""
    ab_lead: str = "static"
    """Benchmarking: the arm of an A/B run's first block, ``static`` (A) or ``dynmo`` (B); the
    bench alternates it from one repeat to the next. In a ``dynmo`` first block the balancer
    has not reported yet, so it runs the static split: the bench sets the first block of each
    arm aside as warm-up."""
    ab_schedule: Literal["1f1b", "1f1b-slack", "gpipe"] | None = None
    """Benchmarking: null, or a second microbatch schedule that odd pairs of A/B blocks run
    instead of ``pipeline.schedule`` (:func:`~dynmo_hpc.train.ab_arms.ab_schedule`)."""

    def validate(self) -> None:
        try:
            check_balance_settings(dataclasses.asdict(self))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.interval < 1:
            raise ConfigError(f"balance.interval={self.interval} must be >= 1")
        if not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(f"balance.smoothing={self.smoothing} must be in (0, 1]")
        if self.margin < 0:
            raise ConfigError(f"balance.margin={self.margin} must be >= 0")
        at_most("balance.margin", self.margin, 1000.0, "a typo? 0.1 asks for a 10 % better plan")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"balance.capacity_bytes={self.capacity_bytes} must be > 0 or null")
        self._validate_ab()

    def _validate_ab(self) -> None:
        if self.ab_lead not in ("static", "dynmo"):
            raise ConfigError(
                f"balance.ab_lead={self.ab_lead!r} is not an A/B arm; HINT: use static or dynmo"
            )
        period = self.ab_period_steps
        if period == 0:
            if self.ab_schedule is not None:
                msg = "compares schedules in an A/B run, but balance.ab_period_steps=0; HINT:"
                hint = f"set balance.ab_period_steps (e.g. {2 * self.interval}) or drop it"
                raise ConfigError(f"balance.ab_schedule={self.ab_schedule} {msg} {hint}")
            return
        if period < 0 or period % self.interval:
            raise ConfigError(
                f"balance.ab_period_steps={period} must be 0 (off) or a positive multiple of "
                f"balance.interval={self.interval}; HINT: the arms switch at a load report, e.g. "
                f"ab_period_steps={2 * self.interval}"
            )
        entry = ALGORITHMS.get(self.algorithm)
        if self.algorithm == STATIC or entry is None or not entry.rebalances or self.force_moves:
            raise ConfigError(
                f"balance.ab_period_steps={period} compares the static split with a balancer's "
                f"plan, but balance.algorithm={self.algorithm}"
                f"{' with force_moves' if self.force_moves else ''}; HINT: set balance.algorithm "
                "to a rebalancing algorithm (e.g. optimal) and force_moves=false"
            )

    def validate_for(self, model: ModelSection) -> None:
        """``capacity_bytes`` must hold the largest layer's weights (4-byte floats) at
        initialization: the least any partition puts on a stage. Smaller is a unit mistake
        (bytes, not MB or GB), and ``optimal`` would find no partition at the first report."""
        if self.capacity_bytes is None:
            return
        params = model.layer_params()
        largest = max(range(len(params)), key=params.__getitem__)
        need_bytes = 4 * params[largest]
        if self.capacity_bytes < need_bytes:
            raise ConfigError(
                f"balance.capacity_bytes={self.capacity_bytes:g} cannot hold layer {largest} "
                f"({params[largest]} parameters = {need_bytes} bytes of float32 weights alone); "
                "HINT: capacity_bytes is in bytes per stage (e.g. 4e9 for 4 GB), or null for "
                "no cap"
            )
