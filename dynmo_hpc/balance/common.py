"""Validation and arithmetic shared by every balancer: costs, partitions, prefix sums, loads.

Why one module: every algorithm must reject the same bad inputs with the same message (negative or
non-finite costs, more stages than layers, a malformed ``current`` partition), and must measure a
stage's load with the *same* arithmetic. The load of stage ``p`` is ``prefix[parts[p+1]] -
prefix[parts[p]]`` over one shared prefix-sum list: because rounding is monotone, that quantity
never decreases when a stage grows, which is what makes the greedy probe and the exact search in
:mod:`.optimal` correct to the last bit, and lets a test compare two partitions' bottlenecks
exactly.

Vocabulary: a *partition* (``parts``) is a list of ``num_stages + 1`` boundaries with
``parts[0] == 0`` and ``parts[-1] == num_layers``; stage ``p`` holds layers
``parts[p] .. parts[p+1]-1``. Every partition this package returns has non-empty stages, so its
boundaries strictly increase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

#: Costs may be passed as a list, a tuple or a 1-D numpy array of seconds per layer per step.
CostsLike = Sequence[float] | np.ndarray


def check_values(values: CostsLike, name: str = "costs") -> list[float]:
    """``values`` as a list of finite, non-negative floats, or ValueError naming the bad entry.

    Why strict: a NaN cost compares false with everything, so a bisection on it silently returns
    garbage; a negative cost breaks the monotonicity every algorithm here relies on.
    """
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat list of numbers, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty; pass one value per layer, e.g. {name}=[1.0, 2.0]")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}]={float(array[i])!r} is invalid: every entry must be finite and >= 0 "
            f"({bad.size} bad entries in total)"
        )
    return [float(x) for x in array]


def check_num_stages(num_stages: int, num_layers: int) -> int:
    """``num_stages`` as a Python int; ValueError unless ``1 <= num_stages <= num_layers``.

    Why an error and not a best effort: the old DeepSpeed partitioner looped forever here, and
    handing back an empty stage gives a rank nothing to run.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int | np.integer):
        raise ValueError(f"num_stages must be an int, got {num_stages!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages={num_stages} > number of layers={num_layers}: every stage needs at least "
            f"one layer; use at most {num_layers} stages or split the model into more layers"
        )
    return int(num_stages)


def check_parts(parts: Sequence[int], num_layers: int, name: str = "parts") -> list[int]:
    """``parts`` as a list of ints if it is a partition of ``num_layers`` with non-empty stages.

    Raises ValueError naming the first broken rule, so a hand-written ``--current`` is easy to fix.
    """
    out = [int(b) for b in parts]
    if any(o != b for o, b in zip(out, parts, strict=True)):
        raise ValueError(f"{name}={list(parts)} must contain whole numbers only")
    if len(out) < 2:
        raise ValueError(f"{name}={out} needs at least two boundaries: [0, num_layers]")
    if out[0] != 0 or out[-1] != num_layers:
        raise ValueError(
            f"{name}={out} must start at 0 and end at the number of layers ({num_layers})"
        )
    for p in range(len(out) - 1):
        if out[p + 1] <= out[p]:
            raise ValueError(
                f"{name}={out}: stage {p} is empty or reversed ({name}[{p}]={out[p]}, "
                f"{name}[{p + 1}]={out[p + 1]}); boundaries must strictly increase"
            )
    return out


def prefix_sums(values: Sequence[float]) -> list[float]:
    """``[0, v0, v0+v1, ...]``: the shared arithmetic for every stage load.

    A Python list, not a numpy array, because the hot loops call :func:`bisect.bisect_right` on it
    one stage at a time, which is several times faster on a list than ``np.searchsorted`` on a
    scalar. Raises ValueError when the total overflows to infinity.
    """
    prefix = [0.0, *accumulate(values)]
    if not math.isfinite(prefix[-1]):
        raise ValueError("the sum of the costs overflows a float; rescale them (e.g. to seconds)")
    return prefix


def loads_from_prefix(prefix: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Per-stage loads ``prefix[parts[p+1]] - prefix[parts[p]]``."""
    return [prefix[parts[p + 1]] - prefix[parts[p]] for p in range(len(parts) - 1)]


def stage_loads(costs: CostsLike, parts: Sequence[int]) -> list[float]:
    """Seconds per step of each stage: the sum of its layers' costs.

    Example: ``stage_loads([1, 2, 3, 4], [0, 2, 4]) == [3.0, 7.0]``.
    """
    values = check_values(costs)
    checked = check_parts(parts, len(values))
    return loads_from_prefix(prefix_sums(values), checked)


def bottleneck(costs: CostsLike, parts: Sequence[int]) -> float:
    """The heaviest stage's load: the predicted seconds per step of the pipeline's steady state."""
    return max(stage_loads(costs, parts))


def memory_values(
    memory: CostsLike | None, capacity: float | None, num_layers: int
) -> tuple[list[float], float] | None:
    """Validated ``(memory per layer, capacity per stage)``, or None when no capacity applies.

    Both must be given together: a capacity without per-layer memory cannot be checked, and
    per-layer memory without a capacity constrains nothing.
    """
    if memory is None and capacity is None:
        return None
    if memory is None or capacity is None:
        raise ValueError(
            "memory= (bytes per layer) and capacity= (bytes per stage) must be given together; "
            f"got memory={'set' if memory is not None else None}, capacity={capacity}"
        )
    mem = check_values(memory, "memory")
    if len(mem) != num_layers:
        raise ValueError(f"memory has {len(mem)} entries but costs has {num_layers}; pass one each")
    cap = float(capacity)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"capacity={capacity!r} must be a finite number of bytes >= 0")
    return mem, cap
