"""Which config changes a resume accepts: one table, one pure judgement.

Why: a checkpoint continues a run only if the resumed job trains the same math from there. Some
keys make the checkpoint's layers meaningless when they change (the model, the schemes, the
data, the seed: :attr:`KeyRule.IDENTITY`); some change the training math from the resumed step on
(learning rate, AdamW betas and weight decay, batch shape, clipping: :attr:`KeyRule.MATH`),
which is sometimes wanted, so the user must say so per key (``--allow-change KEY``); the rest
only change how the run executes or reports (stages, balancing, checkpoint cadence, logging,
SLURM: :attr:`KeyRule.FREE`).

``train.steps`` has its own rule (:attr:`KeyRule.STEPS`): raising it passes (the usual "train
longer"); lowering it needs ``--allow-change train.steps`` (the cosine schedule then ends
sooner); lowering it below the checkpoint's step is always refused, since the run would rewrite
history: a checkpoint labelled with an earlier step holding later weights.

Invariant: every key of :class:`~dynmo_hpc.config.JobConfig` falls under an entry of
:data:`KEY_RULES` (the test checks it); a key no entry covers is judged :attr:`KeyRule.MATH`,
the safe side.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


class KeyRule(enum.Enum):
    """How a resume treats a change of one config key."""

    IDENTITY = "identity"
    """Never accepted: the checkpoint's layers, data position or random streams depend on it."""
    MATH = "math"
    """Refused unless ``--allow-change KEY``: changes the training math from the resumed step."""
    STEPS = "steps"
    """``train.steps``: upwards passes, downwards needs ``--allow-change``, below the
    checkpoint's step is refused."""
    FREE = "free"
    """Passes: cannot change the math (execution, placement, logging, checkpoint cadence)."""


KEY_RULES: dict[str, KeyRule] = {
    "job.seed": KeyRule.IDENTITY,
    "job.name": KeyRule.FREE,
    "job.out_dir": KeyRule.FREE,
    "model": KeyRule.IDENTITY,
    "schemes": KeyRule.IDENTITY,
    "data": KeyRule.IDENTITY,
    "data.cache_dir": KeyRule.FREE,  # where prepared data is kept, not what it holds
    "train": KeyRule.MATH,  # lr, min_lr, warmup, AdamW betas / weight decay, clip, batch shape
    "train.steps": KeyRule.STEPS,
    "train.log_interval": KeyRule.FREE,
    "train.steady_state_step": KeyRule.FREE,
    "train.eval_interval": KeyRule.FREE,  # validation passes leave training bitwise unchanged
    "train.eval_windows": KeyRule.FREE,
    "pipeline": KeyRule.FREE,  # stages and partition: the losses do not depend on them
    "runtime": KeyRule.FREE,
    "balance": KeyRule.FREE,  # migration moves layers with their state, invisible to the math
    "checkpoint": KeyRule.FREE,
    "elastic": KeyRule.FREE,
    "fault": KeyRule.FREE,
    "slurm": KeyRule.FREE,
}
"""Dotted key or section prefix -> rule; the longest matching prefix wins."""


NOT_BITWISE: frozenset[str] = frozenset(
    {"pipeline.replicas", "runtime.device", "pipeline.grad_bucket_mb"}
)
"""FREE keys whose change keeps the training math but not its bits: the gradient all-reduce
sums in another order (replicas, buckets) or another device computes (CPU vs CUDA kernels).
A resume passes them, and logs them as ``config_change`` events (rule ``free``) so that the
step of a loss curve where the bits changed is on record."""


def is_bitwise(key: str) -> bool:
    """False for a key whose change alters the losses' bits (:data:`NOT_BITWISE`, or under a
    MATH / STEPS rule); True for a FREE key that leaves every bit as it was."""
    return classify(key) is KeyRule.FREE and key not in NOT_BITWISE


STEPS_KEY = "train.steps"
"""The one key under :attr:`KeyRule.STEPS`."""


def classify(key: str) -> KeyRule:
    """The rule for dotted ``key`` (longest prefix in :data:`KEY_RULES`; MATH if none)."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        rule = KEY_RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return KeyRule.MATH


@dataclass(frozen=True)
class KeyChange:
    """One key whose value differs between the checkpoint's config and the job's."""

    key: str
    saved: Any
    new: Any
    rule: KeyRule

    def describe(self) -> str:
        """``train.lr 0.001 -> 0.003``."""
        return f"{self.key} {self.saved!r} -> {self.new!r}"


@dataclass(frozen=True)
class ResumeVerdict:
    """What a resume does with each changed key (each change is in exactly one list)."""

    refused: list[KeyChange] = field(default_factory=list)
    """MATH (or lowered ``train.steps``) changes not named by ``--allow-change``."""
    below_checkpoint: KeyChange | None = None
    """``train.steps`` lowered below the checkpoint's step: refused whatever is allowed."""
    identity: list[KeyChange] = field(default_factory=list)
    """IDENTITY changes: never accepted."""
    accepted: list[KeyChange] = field(default_factory=list)
    """MATH changes named by ``--allow-change``: they apply from the resumed step."""
    passed: list[KeyChange] = field(default_factory=list)
    """FREE changes and ``train.steps`` raised."""

    @property
    def ok(self) -> bool:
        return not (self.refused or self.identity or self.below_checkpoint)


def changed_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[KeyChange]:
    """Every key (flattened, dotted) whose value differs, with its rule, sorted by key."""
    keys = sorted(set(saved) | set(current))
    return [
        KeyChange(k, saved.get(k), current.get(k), classify(k))
        for k in keys
        if saved.get(k) != current.get(k)
    ]


def judge_resume(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    checkpoint_step: int,
    allowed: Collection[str] = (),
) -> ResumeVerdict:
    """Sort the changes between the checkpoint's flattened config and the job's.

    ``allowed``: the keys given to ``--allow-change`` (see :func:`check_allowed_keys`).
    """
    sorted_changes: dict[str, list[KeyChange]] = {
        "refused": [],
        "identity": [],
        "accepted": [],
        "passed": [],
    }
    below: KeyChange | None = None
    steps = current.get(STEPS_KEY)
    if isinstance(steps, int) and steps < checkpoint_step:  # changed or not (older checkpoints)
        below = KeyChange(STEPS_KEY, saved.get(STEPS_KEY), steps, KeyRule.STEPS)
    for change in changed_keys(saved, current):
        if change.key != STEPS_KEY or below is None:
            sorted_changes[_bucket(change, allowed)].append(change)
    return ResumeVerdict(below_checkpoint=below, **sorted_changes)


def _bucket(change: KeyChange, allowed: Collection[str]) -> str:
    """Which list of :class:`ResumeVerdict` a change (not below the checkpoint) goes to."""
    if change.rule is KeyRule.IDENTITY:
        return "identity"
    if change.rule is KeyRule.FREE:
        return "passed"
    lowered = (
        isinstance(change.saved, int) and isinstance(change.new, int) and change.new < change.saved
    )
    if change.rule is KeyRule.STEPS and not lowered:
        return "passed"
    return "accepted" if change.key in allowed else "refused"


def check_allowed_keys(allowed: Collection[str], known: Collection[str]) -> str | None:
    """Why ``--allow-change`` keys cannot be accepted (unknown, or IDENTITY), or None."""
    for key in allowed:
        if key not in known:
            return (
                f"--allow-change {key}: no such config key; HINT: give a dotted key such as "
                "train.lr or train.weight_decay"
            )
        if classify(key) is KeyRule.IDENTITY:
            return (
                f"--allow-change {key}: {key} fixes what the checkpoint's layers, data or random "
                "streams mean and cannot change on resume; HINT: start a new run (another "
                "job.name) to change it"
            )
    return None


def refusal_message(verdict: ResumeVerdict, where: str, checkpoint_step: int) -> str | None:
    """The one-line reason a resume is refused (without ``error:``), or None if it may go on.

    Names every offending key with both values (checkpoint -> job) and the fix.
    """
    if verdict.below_checkpoint is not None:
        steps = verdict.below_checkpoint.new
        return (
            f"cannot resume from {where}: train.steps={steps} is below the checkpoint's step "
            f"{checkpoint_step}; HINT: raise train.steps to at least {checkpoint_step}, or pass "
            f"--resume an earlier checkpoint (checkpoint/step_<n> with n <= {steps})"
        )
    if verdict.identity:
        shown = ", ".join(
            f"{c.key} (checkpoint {c.saved!r}, job {c.new!r})" for c in verdict.identity[:6]
        )
        more = f" and {len(verdict.identity) - 6} more" if len(verdict.identity) > 6 else ""
        return (
            f"checkpoint {where} does not fit this job: {shown}{more} differ; HINT: resume with "
            "the job file that wrote it, or start a new run (another job.name, or --overwrite)"
        )
    if verdict.refused:
        shown = ", ".join(c.describe() for c in verdict.refused)
        flags = " ".join(f"--allow-change {c.key}" for c in verdict.refused)
        return (
            f"cannot resume from {where}: the job changes the training math: {shown} "
            f"(checkpoint -> job); HINT: resume with the checkpoint's values, or accept the "
            f"change with {flags}"
        )
    return None
