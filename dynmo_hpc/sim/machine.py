"""What a step costs beyond its layers' compute: the calibrated terms of the simulator.

Why: the run log's layer costs are the thread CPU seconds of each layer's forward and backward,
and nothing else. A measured step also spends wall time on work outside the layers (the
optimizer, the clipping all-reduce and the gather, posting each send and receive, the load
report) and, on a machine with more runnable processes than cores, runs every CPU second slower
than one wall second. Without these terms the simulator predicts well short of the measured
step. Each term here is an explicit input with a unit,
0 (or 1 for the ratio) by default, so a simulation without a machine file is exactly the
compute-only model the hand-computed tests check.

The values come from ``benchmarks/calibrate_sim.py``: the optimizer's seconds per parameter and
the link's latency and bandwidth are measured directly on the machine; the per-step, per-action
and per-report constants are fitted on calibration runs' decomposition (never on the run they
then predict); the wall-per-CPU ratio is measured from the replayed run's own stage times
(``docs/simulate.md``, "Calibration"). It writes them as one JSON object that
``dynmo-hpc simulate --machine FILE`` reads with :func:`load_machine`.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """CPU seconds a stage spends outside its layers' forward and backward.

    All in CPU seconds of one rank, like the layer costs they sit beside: the replay multiplies
    them by the same wall-per-CPU ratio as the layers, because on a shared machine they are
    stretched the same way.
    """

    action_s: float = 0.0
    """Per forward or per backward action: posting its receive and send, the runner's Python."""
    optimizer_s_per_param: float = 0.0
    """Per trainable parameter on the stage, per step: gradient norm, clipping scale, AdamW."""
    step_s: float = 0.0
    """Per step, once: the clipping all-reduce, the gather of losses and stage times."""
    report_s: float = 0.0
    """Per load report (every ``balance.interval`` steps): gather, run-log write, decision."""

    def check(self) -> None:
        """Raise ValueError unless every term is finite and >= 0."""
        for item in fields(self):
            _non_negative(item.name, getattr(self, item.name))

    def stage_tail_s(self, num_params: int) -> float:
        """CPU seconds after the schedule on a stage holding ``num_params`` parameters."""
        return self.step_s + self.optimizer_s_per_param * num_params


@dataclass(frozen=True, kw_only=True)
class LayerRates:
    """What one rank of the machine does per second, for :mod:`dynmo_hpc.sim.cost_model`.

    A layer pass costs ``flops / flops_per_s + bytes / bytes_per_s + overhead_s`` and the
    terms below (:func:`dynmo_hpc.sim.cost_model.pass_time_s`): additive rather than a roofline
    maximum, so that the rates are a linear least-squares fit
    on measured per-layer costs (on a CPU running small layers neither term dominates).
    """

    flops_per_s: float
    """Sustained matmul FLOP/s of one rank (a multiply-add is 2 FLOPs)."""
    bytes_per_s: float
    """Sustained memory bytes per second of one rank."""
    overhead_s: float = 0.0
    """Seconds per layer per pass (forward or backward): Python, dispatch, kernel launches."""
    backward_flops_per_s: float | None = None
    """Matmul FLOP/s in the backward (transposed operands, weight-gradient reductions run at
    another speed than the forward); None: ``flops_per_s``."""
    indexed_bytes_per_s: float | None = None
    """Bytes per second of gathers and scatters (each element moved with its index); None:
    ``bytes_per_s``."""
    op_overhead_s: float = 0.0
    """Seconds per operation per pass (``LayerCost.forward_ops`` / ``backward_ops``): the
    dispatch of each op's kernels, which a layer of many small ops pays many times."""
    attention_flops_per_s: float | None = None
    """FLOP/s of attention's two products (scores and weighted values, forward and backward):
    their inner or outer dimension is the head size, far below a dense matmul's, so a CPU runs
    them several times slower; None: the matmul rates."""
    matmul_op_overhead_s: float | None = None
    """Seconds per matmul op (a Linear's call) per pass; None: ``op_overhead_s``."""
    index_op_overhead_s: float | None = None
    """Seconds per index op (gathers, scatters, top-k and masks of token selection); None:
    ``op_overhead_s``."""
    lookup_op_overhead_s: float | None = None
    """Seconds per embedding lookup op; None: ``op_overhead_s``."""
    weight_bytes_per_s: float | None = None
    """Bytes per second at which a pass reads its parameters (and the backward writes their
    gradients) on top of their share of ``bytes_per_s``: between two passes of a layer the
    other layers run, so its weights come back from memory; None: not charged again."""

    def check(self) -> None:
        """Raise ValueError unless every rate is finite and > 0 and the overheads >= 0."""
        rates = (
            "flops_per_s",
            "bytes_per_s",
            "backward_flops_per_s",
            "indexed_bytes_per_s",
            "attention_flops_per_s",
            "weight_bytes_per_s",
        )
        for name in rates:
            value = getattr(self, name)
            if value is None:
                continue
            _non_negative(name, value)
            if value == 0:
                raise ValueError(f"{name}={value!r} must be > 0")
        _non_negative("overhead_s", self.overhead_s)
        _non_negative("op_overhead_s", self.op_overhead_s)
        for name in ("matmul_op_overhead_s", "index_op_overhead_s", "lookup_op_overhead_s"):
            value = getattr(self, name)
            if value is not None:
                _non_negative(name, value)


@dataclass(frozen=True, kw_only=True)
class MachineModel:
    """A calibration file: the overheads, the link, and optionally a wall-per-CPU ratio and the
    number of cores the ranks share."""

    overheads: Overheads = field(default_factory=Overheads)
    latency_s: float | None = None
    """Seconds per message between neighbouring ranks, waking the waiting rank included."""
    bandwidth_bytes_per_s: float | None = None
    """Point-to-point bytes per second (activation transfers and migrations)."""
    wall_s_per_cpu_s: float | None = None
    """Wall seconds per CPU second of rank work (>= 1 when ranks share cores); None: not fixed
    by the file (``--wall-per-cpu`` decides; 1 without it)."""
    cores: float | None = None
    """Cores the ranks of a run share (:mod:`dynmo_hpc.sim.shared_cores`); None: one a stage."""
    poll_max_s: float | None = None
    """A waiting rank's longest sleep between tests (:func:`dynmo_hpc.sim.wakeup.noticed_s`);
    None: inputs are noticed at once."""
    external_wall_s_per_cpu_s: float | None = None
    """Wall seconds per CPU second that other processes' load adds on top of the ranks' own
    sharing of ``cores``, fitted on calibration runs (:func:`dynmo_hpc.sim.heldout.fit_machine`),
    never on the run predicted: the replay uses it as it is, for every step. None: not fitted
    (a measured ``--wall-per-cpu`` or ``wall_s_per_cpu_s`` decides)."""
    oversubscribed_wall_s_per_cpu_s: float | None = None
    """Wall seconds per CPU second, on top of the simulated sharing of ``cores`` and of
    ``external_wall_s_per_cpu_s``, that a rank time-slicing a core with another rank costs:
    what time-slicing adds beyond each rank's share of the core (context switches, caches
    refilled after each switch, a woken rank waiting for its busy core), beyond the layers' CPU
    seconds growing (``oversubscribed_cpu_s_per_cpu_s``). Fitted on the calibration runs with
    more stages than ``cores`` (:func:`dynmo_hpc.sim.heldout.fit_oversubscribed`); in a step
    whose partition has more stages than ``cores``, the replay multiplies every CPU second of
    the stages whose home core holds another stage by it
    (:func:`dynmo_hpc.sim.replay.time_sliced`), and only with the fitted external load (a
    run's own measured ratio already contains it). None: 1."""
    oversubscribed_cpu_s_per_cpu_s: float | None = None
    """How many times its CPU seconds with a core per rank a layer's thread CPU seconds are
    when the ranks outnumber the cores (caches refilled after every switch): fitted on
    calibration runs of one job at no more and at more stages than ``cores``
    (:func:`dynmo_hpc.sim.oversubscribed_cpu.fit_oversubscribed_cpu`). A held-out prediction
    divides it out of a source's reports measured so and multiplies it into the target's steps
    on more stages than ``cores`` (:func:`dynmo_hpc.sim.oversubscribed_cpu.alone_costs`), so a
    2-rank run predicts a 3-rank one on 2 cores, and a 4-rank run the 2 ranks it packs onto.
    Only with the fitted external load. None: 1."""
    layer_rates: LayerRates | None = None
    """The per-layer cost model's rates (file keys ``layer_flops_per_s``, ``layer_bytes_per_s``,
    ``layer_overhead_s``, given together, and optionally ``layer_backward_flops_per_s``,
    ``layer_indexed_bytes_per_s``, ``layer_op_overhead_s``, ``layer_attention_flops_per_s``,
    ``layer_matmul_op_overhead_s``, ``layer_index_op_overhead_s``, ``layer_lookup_op_overhead_s``,
    ``layer_weight_bytes_per_s``); None: the file has none."""
    notes: dict[str, Any] | None = None
    """Free-form provenance (what was measured, on which runs); never read by the simulator."""

    def check(self) -> None:
        """Raise ValueError on a value no machine could have."""
        self.overheads.check()
        if self.layer_rates is not None:
            self.layer_rates.check()
        for name in ("latency_s", "poll_max_s"):
            value = getattr(self, name)
            if value is not None:
                _non_negative(name, value)
        for name in (
            "bandwidth_bytes_per_s",
            "wall_s_per_cpu_s",
            "cores",
            "external_wall_s_per_cpu_s",
            "oversubscribed_wall_s_per_cpu_s",
            "oversubscribed_cpu_s_per_cpu_s",
        ):
            value = getattr(self, name)
            if value is not None:
                _non_negative(name, value)
                if value == 0:
                    raise ValueError(f"{name}={value!r} must be > 0")

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object :func:`load_machine` reads."""
        out: dict[str, Any] = {
            "action_overhead_s": self.overheads.action_s,
            "optimizer_s_per_param": self.overheads.optimizer_s_per_param,
            "step_overhead_s": self.overheads.step_s,
            "report_overhead_s": self.overheads.report_s,
        }
        for name in (*_OPTIONAL_KEYS, "notes"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.layer_rates is not None:
            for key, attr in {**_RATE_KEYS, **_OPTIONAL_RATE_KEYS}.items():
                value = getattr(self.layer_rates, attr)
                if value is not None:
                    out[key] = value
        return out


_OVERHEAD_KEYS = {
    "action_overhead_s": "action_s",
    "optimizer_s_per_param": "optimizer_s_per_param",
    "step_overhead_s": "step_s",
    "report_overhead_s": "report_s",
}
_RATE_KEYS = {
    "layer_flops_per_s": "flops_per_s",
    "layer_bytes_per_s": "bytes_per_s",
    "layer_overhead_s": "overhead_s",
}
_OPTIONAL_RATE_KEYS = {
    "layer_backward_flops_per_s": "backward_flops_per_s",
    "layer_indexed_bytes_per_s": "indexed_bytes_per_s",
    "layer_op_overhead_s": "op_overhead_s",
    "layer_attention_flops_per_s": "attention_flops_per_s",
    "layer_matmul_op_overhead_s": "matmul_op_overhead_s",
    "layer_index_op_overhead_s": "index_op_overhead_s",
    "layer_lookup_op_overhead_s": "lookup_op_overhead_s",
    "layer_weight_bytes_per_s": "weight_bytes_per_s",
}
_OPTIONAL_KEYS = (
    "latency_s",
    "bandwidth_bytes_per_s",
    "wall_s_per_cpu_s",
    "cores",
    "poll_max_s",
    "external_wall_s_per_cpu_s",
    "oversubscribed_wall_s_per_cpu_s",
    "oversubscribed_cpu_s_per_cpu_s",
)


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")


def _number(name: str, value: object) -> float:
    """JSON ints are numbers too; anything else (a string, a bool, null) is refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r} must be a number")
    return float(value)


def machine_from_json(data: object) -> MachineModel:
    """A :class:`MachineModel` from a parsed JSON object; ValueError names the bad key.

    An unknown key that looks like a misspelling of a known one is refused, so a misspelt term
    cannot silently stay 0; any other unknown key (one a newer version of the file added) is
    logged and ignored, so files from parallel calibrations stay readable.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a machine file holds one JSON object, not {type(data).__name__}")
    known = {*_OVERHEAD_KEYS, *_OPTIONAL_KEYS, *_RATE_KEYS, *_OPTIONAL_RATE_KEYS, "notes"}
    unknown = sorted(set(data) - known)
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if close:
            raise ValueError(
                f"unknown machine key {key!r}; HINT: did you mean {close[0]!r}? "
                f"known: {sorted(known)}"
            )
    if unknown:
        log.warning("machine file: ignoring unknown key(s) %s", ", ".join(unknown))
    values = {key: _number(key, data[key]) for key in _OVERHEAD_KEYS if key in data}
    for key, value in values.items():
        _non_negative(key, value)  # named as in the file, not as the attribute
    overheads = Overheads(**{_OVERHEAD_KEYS[key]: value for key, value in values.items()})
    optional = {key: _number(key, data[key]) for key in _OPTIONAL_KEYS if key in data}
    notes = data.get("notes")
    if notes is not None and not isinstance(notes, dict):
        raise ValueError("notes must be a JSON object")
    model = MachineModel(
        overheads=overheads, layer_rates=_layer_rates(data), notes=notes, **optional
    )
    model.check()
    return model


def _layer_rates(data: dict[str, Any]) -> LayerRates | None:
    """The three ``layer_*`` keys as :class:`LayerRates`; None when none is given; ValueError
    when only some are (a missing rate cannot default to anything meaningful)."""
    given = [key for key in (*_RATE_KEYS, *_OPTIONAL_RATE_KEYS) if key in data]
    if not given:
        return None
    missing = [key for key in _RATE_KEYS if key not in data]
    if missing:
        raise ValueError(
            f"machine file gives {', '.join(given)} but not {', '.join(missing)}; "
            "HINT: the per-layer cost model needs all three layer_* keys"
        )
    keys = {key: attr for key, attr in {**_RATE_KEYS, **_OPTIONAL_RATE_KEYS}.items() if key in data}
    rates = LayerRates(**{attr: _number(key, data[key]) for key, attr in keys.items()})
    for key, attr in keys.items():
        value = getattr(rates, attr)
        _non_negative(key, value)
        if value == 0 and not key.endswith("overhead_s"):
            raise ValueError(f"{key}={value!r} must be > 0")
    return rates


def load_machine(path: Path) -> MachineModel:
    """Read a machine file (``benchmarks/calibrate_sim.py --write-machine``)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read machine file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"machine file {path} is not JSON: {exc}") from None
    try:
        return machine_from_json(data)
    except ValueError as exc:
        raise ValueError(f"machine file {path}: {exc}") from None


SHIPPED_DIR = Path(__file__).resolve().parent / "machines"
"""Machine calibrations shipped with the package, one per machine: ``cpu_<N>core.json``."""


def shipped_machine_path(cores: int) -> Path | None:
    """The calibration shipped for a machine with ``cores`` usable cores, or None.

    Why by core count: the only machine calibrated so far is the project's 2-core development
    machine (``benchmarks/heldout_sim.py --write-machine``); a machine with another core count
    has none, and ``dynmo-hpc simulate`` says so rather than borrow one.
    """
    path = SHIPPED_DIR / f"cpu_{cores}core.json"
    return path if path.is_file() else None


def save_machine(model: MachineModel, path: Path) -> None:
    """Write ``model`` as the JSON :func:`load_machine` reads back unchanged."""
    model.check()
    atomic_write_text(path, json.dumps(model.to_json(), indent=1, sort_keys=True) + "\n")
