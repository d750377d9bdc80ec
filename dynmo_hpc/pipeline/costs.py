"""Per-layer cost measurement: accumulate on every rank, smooth on rank 0.

Each rank's engine times every layer's forward and backward each step (CPU time on CPU: the
calling thread's with one torch thread, the process's per thread with
``runtime.threads_per_rank > 1``, see :mod:`dynmo_hpc.pipeline.device`; CUDA events on GPU).
:class:`IntervalAccumulator` sums those over the steps between two load reports and reports the
mean per step, so one slow step is diluted by the interval. On rank 0, :class:`CostTracker`
keeps an exponential moving average per *global layer* across reports, so a layer keeps its
history when it migrates to another rank, and one noisy report does not trigger a migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_hpc.report_cycle import smooth_costs


@dataclass
class IntervalAccumulator:
    """Sums per-layer forward/backward seconds over the steps since the last report."""

    forward_s: dict[int, float] = field(default_factory=dict)
    backward_s: dict[int, float] = field(default_factory=dict)
    num_steps: dict[int, int] = field(default_factory=dict)

    def add(self, forward_s: dict[int, float], backward_s: dict[int, float]) -> None:
        for index, value in forward_s.items():
            self.forward_s[index] = self.forward_s.get(index, 0.0) + value
            self.backward_s[index] = self.backward_s.get(index, 0.0) + backward_s.get(index, 0.0)
            self.num_steps[index] = self.num_steps.get(index, 0) + 1

    def mean_per_step(self) -> tuple[dict[int, float], dict[int, float]]:
        """Mean seconds per step for each layer seen in the interval, and reset.

        A layer that arrived mid-interval by migration is averaged over the steps it was here.
        """
        fwd = {i: v / self.num_steps[i] for i, v in self.forward_s.items()}
        bwd = {i: v / self.num_steps[i] for i, v in self.backward_s.items()}
        self.forward_s, self.backward_s, self.num_steps = {}, {}, {}
        return fwd, bwd


@dataclass
class CostTracker:
    """Exponential moving average of each global layer's cost (forward + backward, s/step)."""

    num_layers: int
    smoothing: float
    """Weight of the newest report (1.0 = no memory)."""
    costs_s: list[float] | None = None

    def update(self, forward_s: list[float], backward_s: list[float]) -> list[float]:
        if len(forward_s) != self.num_layers or len(backward_s) != self.num_layers:
            raise ValueError(
                f"a load report must cover all {self.num_layers} layers, got "
                f"{len(forward_s)} forward and {len(backward_s)} backward costs"
            )
        latest = [f + b for f, b in zip(forward_s, backward_s, strict=True)]
        self.costs_s = smooth_costs(latest, self.costs_s, self.smoothing)
        return list(self.costs_s)


@dataclass(frozen=True)
class LayerSize:
    """What one layer weighs: what the parameter-count balancer and the migration model use."""

    num_params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes that travel when the layer migrates (weights, gradients, optimizer state)."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class RankReport:
    """One rank's contribution to a load report (what it sends to rank 0)."""

    forward_s: dict[int, float]
    """Per owned global layer: mean forward cost per step over the interval."""
    backward_s: dict[int, float]
    """Per owned global layer: mean backward cost per step over the interval."""
    sizes: dict[int, LayerSize]
    """Per owned global layer: parameters and bytes."""
    peak_mem_bytes: int
    """This rank's peak memory so far (CUDA allocator peak, or the process's max RSS)."""


@dataclass(frozen=True)
class LoadReport:
    """The whole model's costs at one report, by global layer, as rank 0 sees them."""

    step: int
    forward_s: list[float]
    backward_s: list[float]
    sizes: list[LayerSize]
    peak_mem_bytes: list[int]
    """Per rank (stage), in rank order."""

    @property
    def num_params(self) -> list[int]:
        return [s.num_params for s in self.sizes]

    @property
    def layer_bytes(self) -> list[int]:
        return [s.total_bytes for s in self.sizes]


def _one_replica(
    step: int, num_layers: int, ranks: list[RankReport], first_rank: int
) -> LoadReport:
    """Merge one replica's reports (by stage) into one by global layer.

    Every layer must be reported by exactly one stage: a layer reported twice or not at all
    means the ranks disagree about the partition, which must stop the run rather than skew the
    balancer. ``first_rank``: the world rank of the replica's stage 0 (for the messages).
    """
    owner: dict[int, int] = {}
    forward_s = [0.0] * num_layers
    backward_s = [0.0] * num_layers
    sizes = [LayerSize(0, 0, 0, 0)] * num_layers
    for stage, report in enumerate(ranks):
        rank = first_rank + stage
        for index, size in report.sizes.items():
            if index in owner or not 0 <= index < num_layers:
                raise RuntimeError(
                    f"load report at step {step}: layer {index} reported by rank {rank}"
                    + (
                        f" and rank {owner[index]}"
                        if index in owner
                        else f" (not in 0..{num_layers - 1})"
                    )
                )
            owner[index] = rank
            sizes[index] = size
            forward_s[index] = report.forward_s.get(index, 0.0)
            backward_s[index] = report.backward_s.get(index, 0.0)
    missing = [i for i in range(num_layers) if i not in owner]
    if missing:
        raise RuntimeError(
            f"load report at step {step}: no rank of ranks {first_rank}.."
            f"{first_rank + len(ranks) - 1} reported layers {missing}"
        )
    return LoadReport(
        step=step,
        forward_s=forward_s,
        backward_s=backward_s,
        sizes=sizes,
        peak_mem_bytes=[r.peak_mem_bytes for r in ranks],
    )


def assemble_load_report(
    step: int, num_layers: int, ranks: list[RankReport], num_replicas: int = 1
) -> LoadReport:
    """Merge the ranks' reports (in world rank order) into one by global layer; pure.

    With ``num_replicas`` replicas (ranks ``r*P .. r*P+P-1`` are replica ``r``'s stages) every
    layer must be reported once by each replica. A layer's cost is the **largest** over the
    replicas, per direction, and a stage's peak memory the largest over its copies: the replicas
    wait for each other at the gradient all-reduce, so the slowest copy of a stage sets the
    step's pace, and it is that copy the shared partition must balance (a median would ignore a
    consistently slow node, which is exactly what the balancer should move work away from).
    Layer sizes are replica 0's (the replicas hold identical layers).

    Example: two replicas reporting layer 0's forward as 1.0 s and 1.5 s give 1.5 s.
    """
    if num_replicas < 1 or len(ranks) % num_replicas:
        raise ValueError(f"{len(ranks)} rank reports do not split into {num_replicas} replicas")
    num_stages = len(ranks) // num_replicas
    replicas = [
        _one_replica(step, num_layers, ranks[r * num_stages : (r + 1) * num_stages], r * num_stages)
        for r in range(num_replicas)
    ]
    first = replicas[0]
    return LoadReport(
        step=step,
        forward_s=[max(v) for v in zip(*(r.forward_s for r in replicas), strict=True)],
        backward_s=[max(v) for v in zip(*(r.backward_s for r in replicas), strict=True)],
        sizes=first.sizes,
        peak_mem_bytes=[max(v) for v in zip(*(r.peak_mem_bytes for r in replicas), strict=True)],
    )
