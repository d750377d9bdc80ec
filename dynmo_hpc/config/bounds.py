"""Upper and lower limits for the job's numbers, and the one-line errors that refuse them.

Why limits at all: a value no job could use (``runtime.threads_per_rank: 2147483648``,
``job.seed: -1``, ``model.d_model: 1e9``) otherwise fails minutes later on every rank with an
``OverflowError`` or an out-of-memory kill, far from the key that caused it. Each limit is far
beyond any real job (so it never refuses a workable config) and says why it exists.
"""

from __future__ import annotations

from dynmo_hpc.errors import ConfigError

MAX_SEED = 2**32 - 1
"""numpy's and torch's portable seed range is unsigned 32-bit; larger seeds are reduced or
refused differently by each library, so the same job would not see the same batches."""

MAX_WIDTH = 1 << 20
"""d_model, d_ff, d_ff_expert, seq_len, vocab_size: a million is 80x GPT-3's widest matrix; more
is a typo whose first allocation would take the node down."""

MAX_STEPS = 10**9
"""Optimizer steps (and step-valued settings): a billion steps is years of training."""

MAX_BATCH = 1 << 20
"""Sequences per microbatch and microbatches per step."""

MAX_THREADS_PER_RANK = 1024
"""More threads than any node has cores (the submit host's ``os.cpu_count()`` says nothing
about the compute nodes, so the cap is fixed, not measured)."""

MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""A year: longer waits overflow the OS's timeout arithmetic and are never meant."""

MAX_EXPERTS = 1 << 16
"""Experts per MoE block."""

MAX_LOSS_WEIGHT = 100.0
"""An auxiliary loss weighted more than 100x the language-model loss drowns it (and risks
overflow to inf); a typo."""

MAX_CAPACITY_FACTOR = 1000.0
"""MoE capacity factor: num_experts / top_k already fits every token; 1000 is far beyond."""


def at_most(key: str, value: float, limit: float, why: str) -> None:
    """Refuse ``value > limit`` with a one-line error naming the key, the value and why."""
    if value > limit:
        raise ConfigError(f"{key}={value} > {limit}; HINT: {why}")


def in_range(key: str, value: float, low: float, high: float, why: str) -> None:
    """Refuse a value outside the closed interval ``[low, high]``."""
    if not low <= value <= high:
        raise ConfigError(f"{key}={value} must be in [{low}, {high}]; HINT: {why}")


def printable(key: str, value: str | None) -> None:
    """Refuse control characters (newline, tab, NUL): every string here ends up in a path, a
    log line or the sbatch script, where a newline would start a new line of shell."""
    if value is not None and not value.isprintable():
        raise ConfigError(
            f"{key}={value!r} contains control characters (newline, tab, NUL, ...); "
            "HINT: remove them"
        )
