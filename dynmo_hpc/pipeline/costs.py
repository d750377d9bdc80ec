"""Per-layer cost measurement: accumulate on every rank, smooth on rank 0.

Each rank's engine times every layer's forward and backward each step (thread CPU time on CPU,
CUDA events on GPU). :class:`IntervalAccumulator` sums those over the steps between two load
reports and reports the mean per step, so one slow step is diluted by the interval. On rank 0,
:class:`CostTracker` keeps an exponential moving average per *global layer* across reports, so
a layer keeps its history when it migrates to another rank, and one noisy report does not trigger
a migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        if self.costs_s is None:
            self.costs_s = latest
        else:
            a = self.smoothing
            self.costs_s = [
                a * new + (1 - a) * old for new, old in zip(latest, self.costs_s, strict=True)
            ]
        return list(self.costs_s)
