"""The closed-form step and memory model the packing decision prices every size with.

See :mod:`dynmo_hpc.balance.packing` for the model and why; these are its pure formulas (no
decision), kept apart so that the simulator and tests can use them alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynmo_hpc.balance.common import CostsLike, check_parts, check_values, stage_loads


def predict_step_time_s(
    costs_s: CostsLike,
    parts: Sequence[int],
    num_microbatches: int,
    *,
    comm_s: float = 0.0,
    num_cpu_slots: int | None = None,
    num_replicas: int = 1,
    allreduce_s: float = 0.0,
) -> float:
    """Predicted seconds per step of ``parts`` in each of ``num_replicas`` replicas (see the
    module docstring for the model).

    ``costs_s`` are per layer for the whole global batch on one pipeline (what R = 1 measures);
    each replica trains ``num_microbatches / num_replicas`` of the microbatches, then the
    replicas spend ``allreduce_s`` summing gradients.

    Example: 4 layers of 1 s on 2 stages, 4 microbatches, no communication:
    ``(4 + 2 - 1) * (2 / 4) == 2.5``; on 2 replicas ``(2 + 2 - 1) * (2 / 4) == 1.5``.
    """
    values = check_values(costs_s)
    checked = check_parts(parts, len(values))
    if num_microbatches < 1 or num_replicas < 1 or num_microbatches % num_replicas:
        raise ValueError(
            f"num_microbatches={num_microbatches} must be >= 1 and divisible by "
            f"num_replicas={num_replicas} (>= 1)"
        )
    num_stages = len(checked) - 1
    slots = (M := num_microbatches) // num_replicas + num_stages - 1
    per_microbatch_s = max(stage_loads(values, checked)) / M
    if num_stages > 1:
        per_microbatch_s += 2.0 * comm_s
    step_s = slots * per_microbatch_s
    if num_cpu_slots is not None:
        ranks = num_replicas * num_stages
        step_s = max(step_s, sum(values) / min(ranks, max(1, num_cpu_slots)))
    return step_s + allreduce_s


def ring_allreduce_factor(num_replicas: int) -> float:
    """Bytes a ring all-reduce sends per rank, per byte reduced: ``2 (R - 1) / R`` (0 at R = 1).
    The all-reduce time of a candidate is the measured one scaled by this factor's ratio."""
    return 2.0 * (num_replicas - 1) / num_replicas


def nodes_for(num_ranks: int, ranks_per_node: int) -> int:
    """Nodes a job of ``num_ranks`` ranks (replicas x stages) holds at ``ranks_per_node``."""
    return -(-num_ranks // ranks_per_node)


def microbatches_in_flight(num_stages: int, num_microbatches: int, schedule: str) -> int:
    """The most microbatches whose activations one stage of ``num_stages`` holds at once.

    GPipe runs every forward before any backward: ``M``. 1F1B lets stage ``s`` start at most
    ``P - s`` forwards before its first backward, so the worst stage (0) holds ``min(M, P)``;
    ``1f1b-slack`` one more on every stage but the last.
    """
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b-slack" and num_stages > 1:
        return min(num_microbatches, num_stages + 1)  # one forward ahead on all but the last
    return min(num_microbatches, num_stages)


def layer_memory_at(
    fixed_bytes: Sequence[float],
    activation_bytes: Sequence[float] | None,
    in_flight: int,
) -> list[float]:
    """Per layer: what it holds on any stage of a pipeline with ``in_flight`` microbatches in
    flight on its worst stage: fixed bytes plus ``in_flight`` microbatches of activations."""
    if activation_bytes is None:
        return [float(b) for b in fixed_bytes]
    return [
        float(f) + in_flight * float(a) for f, a in zip(fixed_bytes, activation_bytes, strict=True)
    ]


def smaller_sizes(
    num_replicas: int,
    num_stages: int,
    *,
    num_microbatches: int,
    min_stages: int,
    ranks_per_node: int,
    num_layers: int,
    min_replicas: int = 1,
) -> list[tuple[int, int]]:
    """Every (replicas, stages) below the current size that releases a whole node: as many
    replicas or fewer (down to ``min_replicas``, dividing ``num_microbatches``: the global
    batch stays), as many stages or fewer (down to ``min_stages``, at most one layer each)."""
    nodes_now = nodes_for(num_replicas * num_stages, ranks_per_node)
    out = []
    for r in range(num_replicas, max(min_replicas, 1) - 1, -1):
        if num_microbatches % r:
            continue
        for p in range(num_stages, max(min_stages, 1) - 1, -1):
            smaller = (r, p) != (num_replicas, num_stages) and p <= num_layers
            if smaller and nodes_for(r * p, ranks_per_node) < nodes_now:
                out.append((r, p))
    return out
