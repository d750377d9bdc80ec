"""The static baselines: what Megatron-LM and DeepSpeed do once, before training starts.

Three splits, all computed once from data that never changes while training runs:

- :func:`uniform`: equal counts of *all* layers (the trainer's default split), embedding and
  head counted like blocks. That is also Megatron-LM's split with
  ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``
  (the embedding and the head with the loss each count as one layer, and the layers are divided
  evenly; Megatron-LM requires the stage count to divide them, where uniform spreads the
  remainder). On the 3P+2 layers of a 3-blocks-per-stage model it gives some stages one block
  more than others, an imbalance Megatron-LM without those options does not have;
- :func:`megatron`: Megatron-LM's default placement: the transformer blocks divided evenly, the
  embedding with the first stage and the head with the last (no accounting options);
- :func:`parameters`: DeepSpeed's default, balanced parameter counts.

Why they live here: DynMo's claim is a speedup *over* these splits, so the comparison must use
the same validation, the same partition format and the same load arithmetic as the dynamic
balancers. Both are computed from data that does not change while training runs (layer counts,
parameter counts), which is exactly why they drift out of balance when the work per layer does.
"""

from __future__ import annotations

import itertools

from dynmo_hpc.balance.common import CostsLike, check_num_stages, check_values
from dynmo_hpc.balance.optimal import Chain


def uniform(costs: CostsLike, num_stages: int) -> list[int]:
    """The same number of layers on every stage, ignoring the costs (the trainer's default).

    When ``num_stages`` does not divide the layer count, the extra layers are spread evenly
    (boundary ``p`` is ``p * num_layers // num_stages``), so stage sizes differ by at most one.
    ``costs`` is only used for its length and validated like everywhere else.

    Example: ``uniform([1.0] * 10, 4) == [0, 2, 5, 7, 10]``.
    """
    num_layers = len(check_values(costs))
    num_stages = check_num_stages(num_stages, num_layers)
    return [p * num_layers // num_stages for p in range(num_stages + 1)]


def megatron(costs: CostsLike, num_stages: int) -> list[int]:
    """Megatron-LM's placement: blocks split evenly, embedding on the first stage, head on the last.

    Layer 0 is taken to be the embedding and the last layer the head (the model's layout,
    :mod:`dynmo_hpc.model.gpt`); the ``B = len(costs) - 2`` layers between are the blocks.
    ``costs`` is only used for its length and validated like everywhere else.

    The rule, with ``m = ceil(B / P)`` blocks on each middle stage:

    - ``P`` divides ``B``: ``B / P`` blocks on every stage, Megatron-LM's default (its
      ``--num-layers`` must then be a multiple of the pipeline size);
    - otherwise the first and last stages take the ``s = B - (P - 2) m`` blocks the middle
      stages leave, ``ceil(s / 2)`` on the first and ``floor(s / 2)`` on the last (the head,
      a vocabulary-wide matmul and the loss, outweighs the embedding's lookup). That is
      Megatron-LM's uneven split, ``--decoder-first-pipeline-num-layers`` and
      ``--decoder-last-pipeline-num-layers`` (``num_layers_in_first_pipeline_stage`` /
      ``num_layers_in_last_pipeline_stage`` in Megatron Core's ``TransformerConfig``), which
      requires both counts > 0 and the middle stages' blocks to divide evenly. The stages that
      carry the embedding and the head so get at most as many blocks as any other, and no stage
      more than ``m``, the fewest any split of the blocks can manage;
    - when that leaves fewer than one block for each edge stage (``s < 2``, e.g. 16 blocks on 10
      stages), no first/last setting can express a split with ``m`` blocks at most. Then the
      edge stages take one block each (fewer when ``B < P``: the last stage none, the first one
      only when ``B = P - 1``) and the middle stages split the rest
      with at most one block difference (boundary ``q * rest // (P - 2)``); Megatron-LM needs
      its explicit ``--pipeline-model-parallel-layout`` for that;
    - two stages: ``ceil(B / 2)`` blocks on the first, ``floor(B / 2)`` on the last.

    Every stage is non-empty: an edge stage always holds the embedding or the head.

    Examples: ``megatron([1.0] * 26, 8) == [0, 4, 7, 10, 13, 16, 19, 22, 26]`` (3 blocks a
    stage), ``megatron([1.0] * 12, 4) == [0, 3, 6, 9, 12]`` (first 2, middle 3 and 3, last 2).
    """
    num_layers = len(check_values(costs))
    num_stages = check_num_stages(num_stages, num_layers)
    if num_stages == 1:
        return [0, num_layers]
    counts = _edge_and_middle_blocks(num_layers - 2, num_stages)
    counts[0] += 1  # the embedding
    counts[-1] += 1  # the head
    return [0, *itertools.accumulate(counts)]


def _edge_and_middle_blocks(num_blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage, first to last, for :func:`megatron` (``num_stages >= 2``)."""
    if num_stages == 2:
        return [num_blocks - num_blocks // 2, num_blocks // 2]
    middle_stages = num_stages - 2
    per_middle = -(-num_blocks // num_stages)
    edges = num_blocks - middle_stages * per_middle
    if edges >= 2:
        return [edges - edges // 2, *([per_middle] * middle_stages), edges // 2]
    first = 1 if num_blocks >= num_stages - 1 else 0
    last = 1 if num_blocks >= num_stages else 0
    rest = num_blocks - first - last
    bounds = [q * rest // middle_stages for q in range(middle_stages + 1)]
    return [first, *(b - a for a, b in itertools.pairwise(bounds)), last]


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
