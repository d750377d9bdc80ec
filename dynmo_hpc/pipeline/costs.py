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


def assemble_load_report(step: int, num_layers: int, ranks: list[RankReport]) -> LoadReport:
    """Merge the ranks' reports (in rank order) into one by global layer; pure.

    Every layer must be reported by exactly one rank: a layer reported twice or not at all means
    the ranks disagree about the partition, which must stop the run rather than skew the balancer.
    """
    owner: dict[int, int] = {}
    forward_s = [0.0] * num_layers
    backward_s = [0.0] * num_layers
    sizes = [LayerSize(0, 0, 0, 0)] * num_layers
    for rank, report in enumerate(ranks):
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
        raise RuntimeError(f"load report at step {step}: no rank reported layers {missing}")
    return LoadReport(
        step=step,
        forward_s=forward_s,
        backward_s=backward_s,
        sizes=sizes,
        peak_mem_bytes=[r.peak_mem_bytes for r in ranks],
    )
