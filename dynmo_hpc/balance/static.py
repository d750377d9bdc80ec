"""The static baselines: what Megatron-LM and DeepSpeed do once, before training starts.

Why they live here: DynMo's claim is a speedup *over* these splits, so the comparison must use
the same validation, the same partition format and the same load arithmetic as the dynamic
balancers. Both are computed from data that does not change while training runs (layer counts,
parameter counts), which is exactly why they drift out of balance when the work per layer does.
"""

from __future__ import annotations

from dynmo_hpc.balance.common import CostsLike, check_num_stages, check_values
from dynmo_hpc.balance.optimal import Chain


def uniform(costs: CostsLike, num_stages: int) -> list[int]:
    """Megatron-LM's split: the same number of layers on every stage, ignoring the costs.

    When ``num_stages`` does not divide the layer count, the extra layers are spread evenly
    (boundary ``p`` is ``p * num_layers // num_stages``), so stage sizes differ by at most one.
    ``costs`` is only used for its length and validated like everywhere else.

    Example: ``uniform([1.0] * 10, 4) == [0, 2, 5, 7, 10]``.
    """
    num_layers = len(check_values(costs))
    num_stages = check_num_stages(num_stages, num_layers)
    return [p * num_layers // num_stages for p in range(num_stages + 1)]


def parameters(
    costs: CostsLike,
    num_stages: int,
    *,
    params: CostsLike,
) -> list[int]:
    """DeepSpeed's default split: balance *parameter counts*, not time (``partition_method``).

    ``params`` holds the per-layer parameter (or non-zero) counts; ``costs`` stays in seconds, is
    validated and must have the same length, but does not influence the split. Keeping the two
    apart is deliberate: the point of this baseline is that a layer's parameter count is a poor,
    static proxy for its time once experts, pruning, freezing or early exit change the work.

    The split is the exact min-max partition of ``params`` with the same left-greedy tie-break as
    :func:`~dynmo_hpc.balance.optimal.optimal`, which is what DeepSpeed's bisection-plus-probe
    computed before it moved to a variance objective in 2023.

    Example: ``parameters([1.0] * 4, 2, params=[10, 10, 10, 30]) == [0, 3, 4]``.
    """
    num_layers = len(check_values(costs))
    counts = check_values(params, "params")
    if len(counts) != num_layers:
        raise ValueError(
            f"params has {len(counts)} entries but costs has {num_layers}; pass one count per layer"
        )
    num_stages = check_num_stages(num_stages, num_layers)
    chain = Chain(counts, None)
    return chain.build(chain.solve(num_stages), num_stages, None)
