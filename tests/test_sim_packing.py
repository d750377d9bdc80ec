"""The simulator's ``packing``: the trainer's packing decision replayed on a cost
history, with the resize charged to the report step that decides it."""

from __future__ import annotations

import json
import math

import pytest

from dynmo_hpc.balance.restart_overhead import ASSUMED_CHECKPOINT_BYTES_PER_S, estimated_restart_s
from dynmo_hpc.cli import main
from dynmo_hpc.sim.replay import CostReport, PackingSetup, ReplaySetup, replay
from dynmo_hpc.sim.runlog_traces import packing_setup

COSTS = [1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0]
"""One heavy layer sets the pace: 3 stages are as fast as 4 (the packing docstring's case)."""


def _report() -> CostReport:
    n = len(COSTS)
    return CostReport(
        forward_s=[c / 3 for c in COSTS], backward_s=[2 * c / 3 for c in COSTS],
        num_params=[1] * n, layer_bytes=[0] * n,
    )  # fmt: skip


def _setup(**packing: object) -> ReplaySetup:
    return ReplaySetup(
        num_stages=4, num_microbatches=8, interval=2, num_steps=40,
        packing=PackingSetup(**{"interval": 1, "restart_overhead_s": 5.0, **packing}),  # type: ignore[arg-type]
    )  # fmt: skip


def test_packing_frees_a_stage_that_costs_no_throughput() -> None:
    setup = _setup()
    optimal = replay([_report()], setup, "optimal")
    packed = replay([_report()], setup, "packing")
    assert optimal.packs == 0 and len(optimal.final_parts) - 1 == 4
    assert packed.packs == 1 and len(packed.final_parts) - 1 == 3
    assert packed.final_parts[:2] == [0, 3] or 6.0 in [
        sum(COSTS[a:b]) for a, b in zip(packed.final_parts, packed.final_parts[1:], strict=False)
    ]
    # The step that decided it pays the resize; the steps after run on 3 stages as fast as 4.
    paid = [i for i, (p, o) in enumerate(zip(packed.step_times_s, optimal.step_times_s,
                                             strict=True)) if p > o + 1.0]  # fmt: skip
    assert len(paid) == 1
    assert packed.step_times_s[paid[0]] == pytest.approx(optimal.step_times_s[paid[0]] + 5.0)
    assert packed.step_times_s[-1] <= optimal.step_times_s[-1] * 1.1
    assert packed.node_s < optimal.node_s  # the point: fewer node-seconds for the same work


def test_packing_waits_when_the_resize_does_not_pay() -> None:
    """A 1000 s restart cannot pay back in the 38 steps left: no step is saved that long."""
    setup = _setup(restart_overhead_s=1000.0)
    result = replay([_report()], setup, "packing")
    assert result.packs == 0 and len(result.final_parts) - 1 == 4


def test_packing_never_goes_below_min_stages() -> None:
    result = replay([_report()], _setup(min_stages=4), "packing")
    assert result.packs == 0


def test_bad_packing_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="restart_overhead_s"):
        PackingSetup(restart_overhead_s=-1).check()
    with pytest.raises(ValueError, match="packing policy"):
        PackingSetup(pack_policy="fastest").check()
    with pytest.raises(ValueError, match="must be >= 1"):
        PackingSetup(interval=0).check()


def test_cli_packing_and_restart_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--costs", ",".join(str(c) for c in COSTS), "--stages", "4"]
    argv += ["--microbatches", "8", "--interval", "2", "--steps", "40", "--json"]
    assert main([*argv, "--algorithms", "optimal,packing", "--restart-overhead-s", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"optimal", "packing"}
    assert set(out["packing"]) == {"step_time_s", "tokens_per_s"}
    # Without --json the table names the final stage count and the node-seconds.
    assert main([*argv[:-1], "--algorithms", "optimal,packing", "--restart-overhead-s", "5"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["algorithm", "step_time_s", "tokens_per_s", "migrations", "stages",
                                "node_s"]  # fmt: skip
    assert table[2].split()[4] == "4" and table[3].split()[4] == "3"
    assert main([*argv, "--restart-overhead-s", "-1"]) == 2
    assert "restart_overhead_s" in capsys.readouterr().err


def test_restart_overhead_comes_from_the_run() -> None:
    """The job's setting first; null: the run's measurement; none: 10 s."""
    assert packing_setup({"restart_overhead_s": 3.0}, 5.7).restart_overhead_s == 3.0
    assert packing_setup({"restart_overhead_s": None}, 6.1).restart_overhead_s == 6.1
    assert packing_setup({"restart_overhead_s": None}, None).restart_overhead_s == 10.0
    setup = packing_setup({"interval": 3, "policy": "node_hours", "min_stages": 2}, None)
    assert (setup.interval, setup.pack_policy, setup.min_stages) == (3, "node_hours", 2)
    assert packing_setup(None, 4.0) == PackingSetup(restart_overhead_s=4.0)


def test_the_restart_estimate_is_the_trainers_rule() -> None:
    """Start-up plus a checkpoint write and read; before any checkpoint, the state's bytes at
    the assumed disk speed; an unknown start-up counts nothing."""
    assert estimated_restart_s(4.0, 0.5, 1e12) == 5.0
    assert estimated_restart_s(4.0, None, ASSUMED_CHECKPOINT_BYTES_PER_S) == 6.0
    assert estimated_restart_s(math.nan, None, 0.0) == 0.0
