"""Fit a machine's per-layer rates on measured layers, and check them on layers the fit never saw.

Why: :mod:`dynmo_hpc.sim.cost_model` gives each layer's FLOPs, bytes, indexed bytes, weight
bytes and ops of each kind per pass; what a pass costs in seconds on a machine is those times
the machine's :class:`~dynmo_hpc.sim.machine.LayerRates`. The rates are not datasheet figures
on a CPU running small layers (dispatch and caches matter as much as peak FLOP/s), so they are
fitted on real measurements (:mod:`dynmo_hpc.calibrate.cost_measure`) and then validated on a width
left out of the fit: the check that the model carries to shapes it was not fitted on.

The fit: a pass's time is linear in eleven unknowns, ``t = F_fwd a_f + F_bwd a_b + bytes b +
indexed_bytes i + A a_att + weight_bytes w + sum over op kinds of ops_k o_k + c`` (``F_fwd``
and ``F_bwd`` are the matmul FLOPs outside attention, ``F_fwd`` 0 in a backward row and
``F_bwd`` in a forward one; ``A`` the pass's attention FLOPs; ``a_f = 1 / flops_per_s``,
``a_b = 1 / backward_flops_per_s``, ``b = 1 / bytes_per_s``, ``i = 1 / indexed_bytes_per_s``,
``a_att = 1 / attention_flops_per_s``, ``w = 1 / weight_bytes_per_s``; ``o_k`` the per-op
overhead of each op kind: ``op_overhead_s`` for the ``other`` kind, ``matmul_op_overhead_s``,
``index_op_overhead_s``, ``lookup_op_overhead_s``; ``c = overhead_s``). Least squares on
*relative* error (each row divided by its measured time), so a layer a hundred times cheaper
than a block weighs as much as the block; all unknowns >= 0 (an exact non-negative least
squares: the best unconstrained fit over every subset of the unknowns, keeping the best whose
values are all >= 0; eleven unknowns, 2048 small solves). An unknown whose column is 0 in every
row (no measured layer gathers anything) is left out and its rate left unset; a fitted 0 leaves
an optional rate unset and an op kind's overhead at 0.
Pure: numpy on the samples' numbers.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynmo_hpc.sim.cost_model import (
    LayerShape,
    PassWork,
    SchemeState,
    layer_cost,
    layer_times_s,
)
from dynmo_hpc.sim.machine import LayerRates

UNKNOWNS = (
    "forward_s_per_flop",
    "backward_s_per_flop",
    "s_per_byte",
    "s_per_indexed_byte",
    "op_overhead_s",
    "overhead_s",
    "attention_s_per_flop",
    "matmul_op_overhead_s",
    "index_op_overhead_s",
    "lookup_op_overhead_s",
    "s_per_weight_byte",
)
"""The fitted unknowns, in the order of :func:`features` columns."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured layer: what it is and its median forward and backward seconds."""

    label: str
    """E.g. ``d64/t128/b4/mod0.5``: width, sequence, micro batch, state."""
    shape: LayerShape
    state: SchemeState
    forward_s: float
    backward_s: float

    def check(self) -> None:
        """ValueError naming the sample when a time is not a positive finite number."""
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and np.isfinite(value) and value > 0):
                raise ValueError(f"sample {self.label}: {name}={value!r} must be > 0")


def pass_features(work: PassWork) -> list[float]:
    """One pass's row of the fit's design matrix (:data:`UNKNOWNS`)."""
    matmul = work.flops - work.attention_flops
    ops = work.ops_by_kind
    return [
        0.0 if work.backward else matmul,
        matmul if work.backward else 0.0,
        work.nbytes,
        work.indexed_bytes,
        float(ops.get("other", 0)),
        1.0,
        work.attention_flops,
        float(ops.get("matmul", 0)),
        float(ops.get("index", 0)),
        float(ops.get("lookup", 0)),
        work.weight_bytes,
    ]


def features(sample: Sample) -> tuple[list[float], list[float]]:
    """The forward row and the backward row of the fit's design matrix (:data:`UNKNOWNS`)."""
    cost = layer_cost(sample.shape, sample.state)
    return pass_features(cost.pass_work(False)), pass_features(cost.pass_work(True))


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise ``|a x - y|`` over ``x >= 0`` exactly, for the few columns a fit has."""
    n = a.shape[1]
    best, best_residual = np.zeros(n), float(np.sum(y * y))
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            cols = list(subset)
            x_sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[cols] = x_sub
            residual = float(np.sum((a @ x - y) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return best


def _solve(rows: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``rows x = 1`` with each column scaled to max 1 (so the
    solve is well conditioned), columns that are 0 throughout left at 0."""
    scale = np.abs(rows).max(axis=0)
    present = scale > 0
    x = np.zeros(rows.shape[1])
    x[present] = _nnls(rows[:, present] / scale[present], np.ones(len(rows))) / scale[present]
    return x


def fit_rates(samples: Sequence[Sample]) -> LayerRates:
    """The non-negative rates that minimise the samples' squared relative errors.

    ValueError when there are no samples, a sample's time is not positive, or the data cannot
    fix a FLOP or byte rate (every layer measured without matmuls, say; or layers too small for
    their matmuls to show).
    """
    if not samples:
        raise ValueError("no samples to fit; HINT: measure some layers first")
    rows: list[list[float]] = []
    for sample in samples:
        sample.check()
        forward, backward = features(sample)
        rows.append([v / sample.forward_s for v in forward])
        rows.append([v / sample.backward_s for v in backward])
    a = np.array(rows)
    present = dict(zip(UNKNOWNS, (bool(v) for v in np.any(a != 0, axis=0)), strict=True))
    fitted = dict(zip(UNKNOWNS, (float(v) for v in _solve(a)), strict=True))

    def kind_overhead(name: str) -> float | None:
        """An op kind's overhead; None (the default op overhead) when no sample has the kind."""
        return fitted[name] if present[name] else None

    for name in ("forward_s_per_flop", "backward_s_per_flop", "s_per_byte"):
        if fitted[name] <= 0:
            raise ValueError(
                f"the fit leaves {name}={fitted[name]!r}: the samples cannot fix this rate; "
                "HINT: measure wider layers (matmul-bound) and narrow ones (overhead-bound)"
            )
    return LayerRates(
        flops_per_s=1.0 / fitted["forward_s_per_flop"],
        backward_flops_per_s=1.0 / fitted["backward_s_per_flop"],
        bytes_per_s=1.0 / fitted["s_per_byte"],
        indexed_bytes_per_s=_rate(fitted["s_per_indexed_byte"]),
        op_overhead_s=fitted["op_overhead_s"],
        overhead_s=fitted["overhead_s"],
        attention_flops_per_s=_rate(fitted["attention_s_per_flop"]),
        matmul_op_overhead_s=kind_overhead("matmul_op_overhead_s"),
        index_op_overhead_s=kind_overhead("index_op_overhead_s"),
        lookup_op_overhead_s=kind_overhead("lookup_op_overhead_s"),
        weight_bytes_per_s=_rate(fitted["s_per_weight_byte"]),
    )


def _rate(seconds_per_unit: float) -> float | None:
    """An optional rate from its fitted inverse; None when the fit left it at 0 (unset)."""
    return 1.0 / seconds_per_unit if seconds_per_unit > 0 else None


@dataclass(frozen=True)
class LayerError:
    """Predicted against measured for one layer's forward and backward."""

    label: str
    measured_forward_s: float
    predicted_forward_s: float
    measured_backward_s: float
    predicted_backward_s: float

    @property
    def forward_error(self) -> float:
        """``predicted / measured - 1``, forward."""
        return self.predicted_forward_s / self.measured_forward_s - 1

    @property
    def backward_error(self) -> float:
        return self.predicted_backward_s / self.measured_backward_s - 1

    @property
    def total_error(self) -> float:
        """Relative error of forward plus backward (the cost the balancer places)."""
        measured = self.measured_forward_s + self.measured_backward_s
        return (self.predicted_forward_s + self.predicted_backward_s) / measured - 1


def validate(samples: Sequence[Sample], rates: LayerRates) -> list[LayerError]:
    """Each sample's predicted against measured seconds under ``rates``."""
    out = []
    for sample in samples:
        sample.check()
        forward_s, backward_s = layer_times_s(layer_cost(sample.shape, sample.state), rates)
        out.append(
            LayerError(sample.label, sample.forward_s, forward_s, sample.backward_s, backward_s)
        )
    return out


@dataclass(frozen=True)
class ErrorSummary:
    """Largest and median absolute relative error over layers, per pass and for the sum."""

    num_layers: int
    max_forward: float
    median_forward: float
    max_backward: float
    median_backward: float
    max_total: float
    median_total: float

    @property
    def max_any(self) -> float:
        """The worst of forward, backward and total: the figure the 15 % check is on."""
        return max(self.max_forward, self.max_backward, self.max_total)


def summarize(errors: Sequence[LayerError]) -> ErrorSummary:
    """Max and median of ``|error|`` over ``errors`` (ValueError when empty)."""
    if not errors:
        raise ValueError("no layers to summarise; HINT: the held-out width had no samples")
    forward = [abs(e.forward_error) for e in errors]
    backward = [abs(e.backward_error) for e in errors]
    total = [abs(e.total_error) for e in errors]
    return ErrorSummary(
        num_layers=len(errors),
        max_forward=max(forward),
        median_forward=statistics.median(forward),
        max_backward=max(backward),
        median_backward=statistics.median(backward),
        max_total=max(total),
        median_total=statistics.median(total),
    )


def split_width(samples: Sequence[Sample], d_model: int) -> tuple[list[Sample], list[Sample]]:
    """(samples of every other width, samples of width ``d_model``): fit on the first, check on
    the second. ValueError when either side is empty."""
    held = [s for s in samples if s.shape.d_model == d_model]
    rest = [s for s in samples if s.shape.d_model != d_model]
    if not held or not rest:
        widths = sorted({s.shape.d_model for s in samples})
        raise ValueError(
            f"held-out width {d_model} leaves {len(rest)} samples to fit and {len(held)} to "
            f"check; HINT: hold out one of the measured widths {widths}, and measure at least two"
        )
    return rest, held
