"""The pipeline simulator: exact step times for cases worked out by hand, agreement with the
trainer's schedules and with the closed form where that is exact, the replay of a cost history
under each algorithm, and ``dynmo-hpc simulate`` end to end (on a constant cost vector and on a real
run log)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from dynmo_hpc.balance.packing import predict_step_time_s
from dynmo_hpc.cli import main
from dynmo_hpc.cli import simulate as simulate_cli
from dynmo_hpc.pipeline.schedule import Action, build_schedule
from dynmo_hpc.runlog import RunLog
from dynmo_hpc.sim.machine import MachineModel, Overheads, load_machine, save_machine
from dynmo_hpc.sim.orders import orders_from_actions, stage_orders
from dynmo_hpc.sim.overheads import RunDecomposition, decompose, fit_overheads
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, replay, replay_algorithms
from dynmo_hpc.sim.runlog_traces import measured_wall_s_per_cpu_s
from dynmo_hpc.sim.step import simulate_step, stage_times_s, transfer_time_s

# --- one step ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_equal_stages_take_m_plus_p_minus_one_slots(schedule: str) -> None:
    """P=2, M=2, f=1, b=2, no communication: (M + P - 1) * (f + b) = 9.

    GPipe: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7];
    stage 0 B0 [5,7] B1 [7,9]. 1F1B moves stage 1's B0 before its F1, same makespan.
    """
    result = simulate_step([1.0, 1.0], [2.0, 2.0], 2, schedule)
    assert result.step_time_s == 9.0
    assert result.busy_s == [6.0, 6.0]
    assert result.idle_s == [3.0, 3.0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_unequal_stages_hand_timeline(schedule: str) -> None:
    """Stage 0: f=b=1; stage 1: f=b=2; M=3; no communication. Both schedules end at 14.

    1F1B (stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2):
        stage 0: F0 [0,1]  F1 [1,2]  B0 [5,6]  F2 [6,7]  B1 [9,10]  B2 [13,14]
        stage 1: F0 [1,3]  B0 [3,5]  F1 [5,7]  B1 [7,9]  F2 [9,11]  B2 [11,13]
    GPipe (all forwards, then all backwards):
        stage 0: F0 [0,1]  F1 [1,2]  F2 [2,3]  B0 [9,10]  B1 [11,12]  B2 [13,14]
        stage 1: F0 [1,3]  F1 [3,5]  F2 [5,7]  B0 [7,9]   B1 [9,11]   B2 [11,13]
    """
    result = simulate_step([1.0, 2.0], [1.0, 2.0], 3, schedule)
    assert result.step_time_s == 14.0
    assert result.busy_s == [6.0, 12.0]
    assert result.idle_s == [8.0, 2.0]


def test_latency_delays_every_hop() -> None:
    """P=2, M=2, 1F1B, f=b=1, each transfer 0.5 s.

    stage 0: F0 [0,1]  F1 [1,2]      B0 [4,5]      B1 [6,7]
    stage 1: F0 [1.5,2.5]  B0 [2.5,3.5]  F1 [3.5,4.5]  B1 [4.5,5.5]
    (stage 1's F1 input arrives at 2.5 but the stage is busy until 3.5; B1's gradient reaches
    stage 0 at 5.5 + 0.5 = 6.)
    """
    comm_s = transfer_time_s(latency_s=0.25, bandwidth_bytes_per_s=4.0, activation_bytes=1.0)
    assert comm_s == 0.5
    assert simulate_step([1.0, 1.0], [1.0, 1.0], 2, "1f1b", comm_s=comm_s).step_time_s == 7.0
    # One microbatch: the critical path is every compute plus one hop each way.
    assert simulate_step([1.0, 1.0], [1.0, 1.0], 1, "gpipe", comm_s=0.5).step_time_s == 5.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_microbatches", [1, 3, 7])
def test_one_stage_is_m_times_f_plus_b(schedule: str, num_microbatches: int) -> None:
    result = simulate_step([0.5], [1.25], num_microbatches, schedule, comm_s=3.0)
    assert result.step_time_s == num_microbatches * 1.75
    assert result.idle_s == [0.0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 1), (3, 4), (4, 8), (6, 5)])
def test_equal_stages_agree_with_the_closed_form(
    schedule: str, num_stages: int, num_microbatches: int
) -> None:
    """With equal stages and no communication, predict_step_time_s is exact."""
    num_layers = 2 * num_stages
    forward_layer_s, backward_layer_s = [1.0] * num_layers, [2.0] * num_layers
    parts = list(range(0, num_layers + 1, 2))
    simulated = simulate_step(
        stage_times_s(forward_layer_s, parts, num_microbatches),
        stage_times_s(backward_layer_s, parts, num_microbatches),
        num_microbatches,
        schedule,
    ).step_time_s
    predicted = predict_step_time_s([3.0] * num_layers, parts, num_microbatches)
    assert simulated == pytest.approx(predicted, rel=1e-12)


def test_many_stages_exact_and_busy_plus_idle_is_the_step() -> None:
    result = simulate_step([1.0] * 256, [2.0] * 256, 512, "1f1b")
    assert result.step_time_s == (512 + 256 - 1) * 3.0
    pairs = zip(result.busy_s, result.idle_s, strict=True)
    assert all(busy + idle == result.step_time_s for busy, idle in pairs)


def test_a_slow_middle_stage_sets_the_pace() -> None:
    """Many microbatches: the step approaches M x the slowest stage's f + b."""
    result = simulate_step([1.0, 3.0, 1.0], [1.0, 3.0, 1.0], 50, "1f1b")
    assert 50 * 6.0 <= result.step_time_s <= 50 * 6.0 + 2 * 2 * 2.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-slack"])
def test_orders_equal_the_trainers_action_lists(schedule: str) -> None:
    for num_stages in range(1, 9):
        for num_microbatches in range(1, 11):
            fast = stage_orders(schedule, num_stages, num_microbatches)
            lists = [
                build_schedule(schedule, s, num_stages, num_microbatches) for s in range(num_stages)
            ]
            slow = orders_from_actions(lists)
            assert (fast.is_backward == slow.is_backward).all(), (num_stages, num_microbatches)
            assert (fast.microbatch == slow.microbatch).all(), (num_stages, num_microbatches)


def test_explicit_orders_that_deadlock_are_refused() -> None:
    """Stage 0 waiting for a backward before sending any forward can never start."""
    lists = [
        [Action(0, "B", 0), Action(0, "F", 0)],
        [Action(1, "F", 0), Action(1, "B", 0)],
    ]
    with pytest.raises(ValueError, match="deadlock"):
        simulate_step([1.0, 1.0], [1.0, 1.0], 1, orders=orders_from_actions(lists))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_s": [1.0, float("nan")]}, "forward_s"),
        ({"backward_s": [1.0]}, "one per stage"),
        ({"num_microbatches": 0}, "num_microbatches"),
        ({"schedule": "zb"}, "unknown schedule"),
        ({"comm_s": -1.0}, "comm_s"),
        ({"action_overhead_s": float("inf")}, "action_overhead_s"),
        ({"stage_overhead_s": [1.0]}, "stage_overhead_s has 1 entries"),
        ({"stage_overhead_s": [1.0, -1.0]}, "stage_overhead_s"),
    ],
)
def test_bad_step_inputs_are_value_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "forward_s": [1.0, 1.0],
        "backward_s": [1.0, 1.0],
        "num_microbatches": 2,
        "schedule": "1f1b",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate_step(**args)  # type: ignore[arg-type]


def test_action_overhead_lengthens_every_action() -> None:
    """P=2, M=2, f=b=1 plus 0.5 s an action: equal stages of f=b=1.5, so (M + P - 1) x 3 = 9;
    busy M x (f + b + 2 x 0.5) = 6. GPipe with one microbatch: four actions in a row, 6 s."""
    result = simulate_step([1.0, 1.0], [1.0, 1.0], 2, "1f1b", action_overhead_s=0.5)
    assert (result.step_time_s, result.busy_s, result.idle_s) == (9.0, [6.0, 6.0], [3.0, 3.0])
    assert simulate_step([1.0] * 2, [1.0] * 2, 1, "gpipe", action_overhead_s=0.5).step_time_s == 6.0


def test_stage_overhead_adds_the_largest_to_the_makespan() -> None:
    """The 9 s step of P=2, M=2, f=1, b=2, then 0.5 s and 2 s after each stage's schedule: the
    gather waits for the slower optimizer, 9 + 2 = 11; busy 6 + 0.5 and 6 + 2."""
    result = simulate_step([1.0, 1.0], [2.0, 2.0], 2, "1f1b", stage_overhead_s=[0.5, 2.0])
    assert (result.step_time_s, result.busy_s, result.idle_s) == (11.0, [6.5, 8.0], [4.5, 3.0])


# --- replay ------------------------------------------------------------------------------------


def _report(costs: list[float], layer_bytes: int = 10**9) -> CostReport:
    """Per-layer seconds per step, one third forward and two thirds backward."""
    return CostReport(
        forward_s=[c / 3 for c in costs],
        backward_s=[2 * c / 3 for c in costs],
        num_params=[100] * len(costs),
        layer_bytes=[layer_bytes] * len(costs),
    )


SETUP = ReplaySetup(
    num_stages=2,
    num_microbatches=2,
    schedule="1f1b",
    interval=2,
    num_steps=6,
    bandwidth_bytes_per_s=1e9,
    smoothing=1.0,
)


def test_replay_migrates_when_it_pays_and_charges_the_move() -> None:
    """Two reports: 4 equal layers of 3 s, then layer 0 at 9 s (steps 4-5 keep the last report).

    steps 0-1: parts [0,2,4], stages 6 s each -> f=1, b=2 per microbatch: 3 * 3 = 9 s.
    steps 2-3: still [0,2,4], stages 12 s and 6 s -> the 1F1B timeline gives 13 s:
        stage 0: F0 [0,2] F1 [2,4] B0 [5,9] B1 [9,13]; stage 1: F0 [2,3] B0 [3,5] F1 [5,6] B1 [6,8].
    report at step 3: optimal [0,1,4] (9 s, 9 s); gain (12 - 9) * 2 steps = 6 s > 1.1 x 1 s
    (layer 1 moves, 1 GB at 1 GB/s): enact.
    steps 4-5: equal stages of 9 s -> f=1.5, b=3: 3 * 4.5 = 13.5 s. The 1 s of migration is
    step 3's, the report step (the trainer logs a step with its load report and migration).
    (The bottleneck rule enacts a partition slower on this short pipeline: the bubble.)
    """
    reports = [_report([3.0] * 4), _report([9.0, 3.0, 3.0, 3.0])]
    static = replay(reports, SETUP, "uniform")
    assert static.step_times_s == [9.0, 9.0, 13.0, 13.0, 13.0, 13.0]
    assert static.migrations == 0
    for algorithm in ("optimal", "diffusion"):
        dynamic = replay(reports, SETUP, algorithm)
        assert dynamic.step_times_s == [9.0, 9.0, 13.0, 14.0, 13.5, 13.5], algorithm
        assert (dynamic.migrations, dynamic.migration_s) == (1, 1.0)
        assert dynamic.final_parts == [0, 1, 4]
        assert dynamic.median_step_time_s == 13.25  # 9, 9, 13, 13.5, 13.5, 14
        assert dynamic.tokens_per_s(10.0) == pytest.approx(60.0 / 72.0)


def test_replay_calibrated_terms_hand_computed() -> None:
    """4 layers of 3 CPU s (100 parameters each) on [0,2,4], M=2: f=1, b=2 a microbatch, 9 s.
    Wall per CPU 2: f=2, b=4. Each action +0.25 CPU s: f=2.5, b=4.5, makespan 3 x 7 = 21 s.
    After the schedule 0.5 + 0.01 x 200 = 2.5 CPU s, i.e. 5 s: 26 s. Each interval's last step
    also reports, 1 CPU s, 2 s: 28 s."""
    report = replace(_report([3.0] * 4), wall_s_per_cpu_s=2.0)
    overheads = Overheads(action_s=0.25, optimizer_s_per_param=0.01, step_s=0.5, report_s=1.0)
    result = replay([report], replace(SETUP, overheads=overheads), "uniform")
    assert result.step_times_s == [26.0, 28.0] * 3
    assert replay([report], SETUP, "uniform").step_times_s == [18.0] * 6  # the ratio alone


def test_replay_keeps_the_partition_when_migration_costs_more() -> None:
    """The same history, but each layer weighs 10 GB: 10 s of migration > 6 s of gain."""
    reports = [_report([3.0] * 4, 10**10), _report([9.0, 3.0, 3.0, 3.0], 10**10)]
    result = replay(reports, SETUP, "optimal")
    assert result.migrations == 0
    assert result.step_times_s == replay(reports, SETUP, "uniform").step_times_s


def test_parameters_algorithm_splits_by_parameter_count() -> None:
    report = CostReport(
        forward_s=[1.0] * 4, backward_s=[1.0] * 4, num_params=[30, 10, 10, 10], layer_bytes=[0] * 4
    )
    assert replay([report], SETUP, "parameters").final_parts == [0, 1, 4]
    assert replay([report], SETUP, "uniform").final_parts == [0, 2, 4]


@pytest.mark.parametrize(
    ("reports", "setup", "algorithm", "match"),
    [
        ([_report([1.0, 1.0])], ReplaySetup(num_stages=3, num_microbatches=2), "optimal", "> n"),
        ([], SETUP, "optimal", "no load reports"),
        ([_report([1.0, 1.0])], SETUP, "greedy", "unknown algorithm"),
        ([_report([1.0, float("nan")])], SETUP, "uniform", "finite"),
        ([_report([1.0, 1.0])], ReplaySetup(num_stages=2, num_microbatches=0), "uniform", ">= 1"),
        ([_report([1.0, 1.0]), _report([1.0, 1.0, 1.0])], SETUP, "uniform", "same layers"),
        ([replace(_report([1.0, 1.0]), wall_s_per_cpu_s=0.0)], SETUP, "uniform", "wall_s_per"),
        ([replace(_report([1.0] * 2), step_wall_s_per_cpu_s=[-1.0])], SETUP, "uniform", "> 0"),
        ([_report([1.0] * 2)], replace(SETUP, overheads=Overheads(step_s=-1)), "uniform", "step_s"),
    ],
)
def test_bad_replay_inputs_are_value_errors(
    reports: list[CostReport], setup: ReplaySetup, algorithm: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        replay(reports, setup, algorithm)


# --- calibration -------------------------------------------------------------------------------


def _run_log(step_time_s: list[float]) -> RunLog:
    """A hand-made run log: P=2, M=2, static, one layer a stage (0.125 s forward, 0.25 s backward
    of CPU, 1000 and 3000 parameters), reports at steps 1 and 3, 0.75 s a stage in layers."""
    steps = range(len(step_time_s))
    reports = [1, 3]
    config = {
        "pipeline": {"num_stages": 2, "schedule": "1f1b"},
        "train": {"num_microbatches": 2},
        "balance": {"algorithm": "static"},
    }
    times = [(t, s, 0.75, 0.125 if s == 0 else 0.0625) for t in steps for s in (0, 1)]
    costs = [(r, layer, 0.125, 0.25, 1000 + 2000 * layer) for r in reports for layer in (0, 1)]
    return RunLog(
        path=Path("hand.h5"),
        attrs={},
        config=config,
        steps=pd.DataFrame({"step": list(steps), "step_time_s": step_time_s}),
        stage_times=pd.DataFrame(times, columns=["step", "stage", "compute_s", "idle_s"]),
        layer_costs=pd.DataFrame(
            costs, columns=["step", "layer", "forward_s", "backward_s", "num_params"]
        ),
        partitions=pd.DataFrame(
            [(r, s, s, s + 1) for r in reports for s in (0, 1)],
            columns=["step", "stage", "start_layer", "end_layer"],
        ),
        events=pd.DataFrame(),
        superseded={},
    )


def test_measured_wall_per_cpu_per_step() -> None:
    """Per step 1.5 s of wall in layers (both stages) for 0.75 s of CPU: 2. A step with 7.5 s in
    layers (another process took the cores) has its own ratio, 10."""
    run = _run_log([1.0, 1.25, 1.0, 1.25])
    assert measured_wall_s_per_cpu_s(run, [1, 3]) == [[2.0, 2.0], [2.0, 2.0]]
    compute_s = [0.75] * 4 + [3.75] * 2 + [0.75] * 2
    spiked = replace(run, stage_times=run.stage_times.assign(compute_s=compute_s))
    assert measured_wall_s_per_cpu_s(spiked, [1, 3]) == [[2.0, 2.0], [10.0, 2.0]]
    empty = replace(run, stage_times=run.stage_times[run.stage_times["step"] > 1])
    assert measured_wall_s_per_cpu_s(empty, [1, 3]) == [None, [2.0, 2.0]]


def test_replay_per_step_ratios() -> None:
    """The 9 s step of 4 layers of 3 CPU s, at ratios 1, 3 within the first interval; the second
    report has none listed, so its median-like ``wall_s_per_cpu_s`` (2) holds."""
    first = replace(_report([3.0] * 4), wall_s_per_cpu_s=2.0, step_wall_s_per_cpu_s=[1.0, 3.0])
    second = replace(_report([3.0] * 4), wall_s_per_cpu_s=2.0)
    result = replay([first, second], replace(SETUP, num_steps=4), "uniform")
    assert result.step_times_s == [9.0, 27.0, 18.0, 18.0]
    # Past the last report, its costs repeat at its own wall_s_per_cpu_s, not its step list.
    assert replay([first], replace(SETUP, num_steps=4), "uniform").step_times_s == [9, 27, 18, 18]


def test_decompose_hand_run() -> None:
    """Steps of 1 s (1.25 s with a report): stage 0 has 0.75 s in layers, 0.125 s idle, so
    0.125 s of rest (0.0625 CPU s at k=2), and 0.25 s more on report steps (0.125 CPU s)."""
    d = decompose(_run_log([1.0, 1.25, 1.0, 1.25]), "hand")
    assert (d.num_stages, d.num_microbatches, d.schedule, d.algorithm) == (2, 2, "1f1b", "uniform")
    assert d.step_s == 1.125
    assert d.compute_s == [0.75, 0.75] and d.layer_cpu_s == [0.375, 0.375]
    assert d.idle_s == [0.125, 0.0625] and d.rest_s == [0.125, 0.1875]
    assert d.wall_s_per_cpu_s == 2.0 and d.stage_params == [1000, 3000]
    assert (d.rest_cpu_s, d.report_cpu_s) == (0.0625, 0.125)
    assert d.report_extra_s == 0.25


def _decomposition(m: int, rest_cpu_s: float, report_cpu_s: float = 0.0) -> RunDecomposition:
    return RunDecomposition(
        name=f"m{m}", num_stages=2, num_microbatches=m, schedule="1f1b", algorithm="uniform",
        step_s=1.0, compute_s=[], layer_cpu_s=[], idle_s=[], rest_s=[], report_extra_s=0.0,
        wall_s_per_cpu_s=1.0, stage_params=[10**6, 5 * 10**5], rest_cpu_s=rest_cpu_s,
        report_cpu_s=report_cpu_s,
    )  # fmt: skip


def test_fit_overheads_recovers_hand_constants() -> None:
    """rest = 2M x 1 ms + 5 ms + 10 ns x 10**6 parameters: M=4 gives 23 ms, M=8 31 ms."""
    runs = [_decomposition(4, 0.023, 0.002), _decomposition(8, 0.031, 0.004)]
    fitted = fit_overheads([*runs, _decomposition(8, 0.031, 0.003)], 1e-8)
    assert fitted.action_s == pytest.approx(0.001) and fitted.step_s == pytest.approx(0.005)
    assert (fitted.optimizer_s_per_param, fitted.report_s) == (1e-8, pytest.approx(0.003))
    # More microbatches but less rest: no negative action cost, the mean of 20 and 10 ms.
    shrinking = fit_overheads([_decomposition(4, 0.03), _decomposition(8, 0.02)], 1e-8)
    assert shrinking.action_s == 0.0 and shrinking.step_s == pytest.approx(0.015)
    single = fit_overheads([_decomposition(4, 0.03)], 0.0)  # one M: all of it per step
    assert (single.action_s, single.step_s) == (0.0, pytest.approx(0.03))


def test_machine_file_round_trip(tmp_path: Path) -> None:
    model = MachineModel(
        overheads=Overheads(action_s=1e-4, optimizer_s_per_param=2e-8, step_s=3e-3, report_s=0.01),
        latency_s=5e-5,
        bandwidth_bytes_per_s=2e9,
        notes={"fitted_on": ["a", "b"]},
    )
    save_machine(model, tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json") == model
    (tmp_path / "partial.json").write_text('{"step_overhead_s": 1}')
    assert load_machine(tmp_path / "partial.json") == MachineModel(overheads=Overheads(step_s=1.0))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[1]", "one JSON object"),
        ('{"step_overhead": 1}', "unknown machine key 'step_overhead'; HINT: did you mean"),
        ('{"step_overhead_s": "1"}', "step_overhead_s='1' must be a number"),
        ('{"latency_s": true}', "must be a number"),
        ('{"action_overhead_s": -1}', "action_overhead_s=-1.0 must be >= 0"),
        ('{"bandwidth_bytes_per_s": 0}', "bandwidth_bytes_per_s=0.0 must be > 0"),
        ('{"notes": 3}', "notes must be a JSON object"),
        ("step_overhead_s = 1", "is not JSON"),
    ],
)
def test_bad_machine_files_are_value_errors(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_machine(tmp_path / "m.json")


# --- dynmo-hpc simulate ------------------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``dynmo-hpc simulate ARGV`` in-process; an argparse error's SystemExit is its code."""
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


COSTS = ["--costs", "4,1,1,1,1,1,1,1", "--stages", "2", "--microbatches", "4"]


def test_cli_json_has_every_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli([*COSTS, "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert list(result) == list(replay_algorithms())
    assert all(set(v) == {"step_time_s", "tokens_per_s"} for v in result.values())
    # uniform: [0,4,8], loads 7 s and 4 s per step, forward a third; 4 tokens per step.
    uniform_s = simulate_step([7 / 12, 1 / 3], [14 / 12, 2 / 3], 4, "1f1b").step_time_s
    assert result["uniform"]["step_time_s"] == pytest.approx(uniform_s)
    assert result["uniform"]["tokens_per_s"] == pytest.approx(4 / uniform_s)
    # The dynamic balancers move one layer (free: --layer-bytes defaults to 0) and are faster.
    assert result["optimal"]["step_time_s"] < result["uniform"]["step_time_s"]
    assert result["diffusion"]["step_time_s"] == result["optimal"]["step_time_s"]


def test_cli_table_and_algorithm_subset(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli([*COSTS, "--algorithms", "uniform,optimal", "--schedule", "gpipe"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("2 stages, 4 microbatches, gpipe")
    assert [line.split()[0] for line in lines[2:]] == ["uniform", "optimal"]
    assert lines[3].split()[3] == "1"  # optimal migrated once


def test_cli_deprecated_policies_flag_still_works_and_names_algorithms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--policies`` is the old name of ``--algorithms``: the same result, and a warning
    (the package's log goes to stderr)."""
    rc, new, err = _cli([*COSTS, "--algorithms", "uniform,optimal", "--json"], capsys)
    assert rc == 0, err
    assert "deprecated" not in err
    rc, old, err = _cli([*COSTS, "--policies", "uniform,optimal", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(old) == json.loads(new)
    assert "--policies is deprecated; use --algorithms" in err
    rc, _, err = _cli([*COSTS, "--policies", "uniform", "--algorithms", "optimal"], capsys)
    assert rc == 2 and "not allowed with argument" in err


def test_cli_logs_progress_of_a_long_replay(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Progress goes to the log (stderr); stdout keeps only the JSON."""
    monkeypatch.setattr(simulate_cli, "PROGRESS_EVERY_S", 0.0)
    rc, out, err = _cli([*COSTS, "--algorithms", "optimal", "--steps", "30", "--json"], capsys)
    assert rc == 0, err
    assert "simulate optimal: step 30/30" in err
    assert list(json.loads(out)) == ["optimal"]


def test_cli_machine_file_and_wall_per_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The replay test's hand case through the command: 26 s and 28 s (report) steps, median
    27, 2 tokens a step; the machine's latency applies unless --latency-s overrides it."""
    machine = tmp_path / "machine.json"
    terms = {
        "action_overhead_s": 0.25,
        "optimizer_s_per_param": 0.01,
        "step_overhead_s": 0.5,
        "report_overhead_s": 1.0,
    }
    machine.write_text(json.dumps({**terms, "latency_s": 0.0, "wall_s_per_cpu_s": 2.0}))
    costs = ["--costs", "3,3,3,3", "--params", "100,100,100,100", "--stages", "2"]
    argv = [*costs, "--microbatches", "2", "--interval", "2", "--steps", "6", "--json"]
    rc, out, err = _cli([*argv, "--algorithms", "uniform", "--machine", str(machine)], capsys)
    assert rc == 0, err
    assert json.loads(out)["uniform"] == {"step_time_s": 27.0, "tokens_per_s": 12 / 162}
    # --wall-per-cpu overrides the file's ratio: 1 gives f=1.25, b=2.25 (10.5), + 2.5, + 1.
    rc, out, _ = _cli([*argv, "--algorithms", "uniform", "--machine", str(machine),
                       "--wall-per-cpu", "1"], capsys)  # fmt: skip
    assert json.loads(out)["uniform"]["step_time_s"] == 13.5
    machine.write_text(json.dumps({**terms, "latency_s": 1.0}))
    _, out, _ = _cli([*argv, "--algorithms", "uniform", "--machine", str(machine)], capsys)
    latency = json.loads(out)["uniform"]["step_time_s"]
    _, out, _ = _cli([*argv, "--algorithms", "uniform", "--machine", str(machine),
                      "--latency-s", "0"], capsys)  # fmt: skip
    assert latency > json.loads(out)["uniform"]["step_time_s"] == 13.5


def _one_error_line(rc: int, out: str, err: str) -> str:
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "HINT: " in lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--costs", "1,2", "--stages", "3", "--microbatches", "2"], "num_stages=3 > number"),
        (["--costs", "1,nan", "--stages", "2", "--microbatches", "2"], "--costs[1]=nan"),
        (["--costs", "1,2", "--stages", "2", "--microbatches", "0"], "num_microbatches=0"),
        (["--costs", "1,2", "--stages", "2", "--microbatches", "-3"], "num_microbatches=-3"),
        (["--costs", "1,2", "--stages", "2"], "--costs needs --microbatches"),
        (["--costs", "1,2", "--stages", "0", "--microbatches", "2"], "num_stages=0"),
        ([*COSTS, "--bandwidth-gbps", "nan"], "bandwidth"),
        ([*COSTS, "--bandwidth-bytes-per-s", "0"], "bandwidth"),
        ([*COSTS, "--latency-s", "-1"], "latency_s"),
        ([*COSTS, "--interval", "0"], "interval=0"),
        ([*COSTS, "--algorithms", "fastest"], "unknown algorithm fastest"),
        ([*COSTS, "--params", "1,2"], "--params has 2 entries"),
        (["--costs", "1,x", "--stages", "2"], "comma-separated numbers"),
        (["--stages", "2"], "one of the arguments --from --costs is required"),
        (["--from", "/nonexistent/run.h5"], "no run log"),
        ([*COSTS, "--wall-per-cpu", "run"], "--wall-per-cpu run needs --from"),
        ([*COSTS, "--wall-per-cpu", "run-interval"], "--wall-per-cpu run-interval needs --from"),
        ([*COSTS, "--wall-per-cpu", "fast"], "neither a number nor 'run'"),
        ([*COSTS, "--wall-per-cpu", "0"], "must be finite and > 0"),
        ([*COSTS, "--machine", "/nonexistent/machine.json"], "cannot read machine file"),
    ],
)
def test_cli_bad_input_is_one_error_line(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_error_line(*_cli(argv, capsys))
    assert match in line


def test_cli_refuses_a_file_that_is_not_a_run_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.h5"
    path.write_bytes(b"not hdf5 at all")
    assert "not a dynmo_hpc run log" in _one_error_line(*_cli(["--from", str(path)], capsys))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-stage run of 6 steps with a load report every 2 steps (about 15 s)."""
    from dynmo_hpc.launch.local import run_local
    from tests.helpers.jobs import tiny_config

    cfg = tiny_config(
        tmp_path_factory.mktemp("simulate"),
        "job.name=sim",
        "pipeline.num_stages=2",
        "train.steps=6",
        "balance.interval=2",
    )
    assert run_local(cfg, timeout_s=180).exit_code == 0
    return cfg.run_dir / "run.h5"


@pytest.mark.slow
def test_cli_from_a_real_run_log(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dynmo_hpc.runlog import load
    from dynmo_hpc.sim.runlog_traces import traces_from_runlog

    # --machine none: the compute-only model (by default --from uses the machine's calibration,
    # tests/test_heldout.py).
    rc, out, err = _cli(["--from", str(tiny_run), "--json", "--machine", "none"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert list(result) == list(replay_algorithms())
    traces = traces_from_runlog(load(tiny_run))
    assert len(traces.reports) == 3 and traces.interval == 2 and traces.num_stages == 2
    assert traces.tokens_per_microbatch == 2 * 32  # micro_batch_size x seq_len of the tiny job
    for values in result.values():
        assert values["step_time_s"] > 0
    # Static uniform on the run's own partition: tokens/s is tokens per step over the mean step.
    uniform_setup = ReplaySetup(
        num_stages=2,
        num_microbatches=4,
        interval=2,
        comm_s=transfer_time_s(0.0, 100e9 / 8, traces.activation_bytes),
    )
    uniform = replay(traces.reports, uniform_setup, "uniform")
    assert result["uniform"]["step_time_s"] == pytest.approx(uniform.median_step_time_s)
    assert result["uniform"]["tokens_per_s"] == pytest.approx(uniform.tokens_per_s(64 * 4))
    # --wall-per-cpu run: each step's costs stretched by its ratio measured from the log.
    rc, out, err = _cli(["--from", str(tiny_run), "--algorithms", "uniform", "--json",
                         "--wall-per-cpu", "run", "--machine", "none"], capsys)  # fmt: skip
    assert rc == 0, err
    measured = traces.step_wall_s_per_cpu_s
    assert all(ks is not None and len(ks) == 2 and min(ks) > 0 for ks in measured)
    stretched = [
        replace(r, wall_s_per_cpu_s=statistics.median(ks), step_wall_s_per_cpu_s=ks)
        for r, ks in zip(traces.reports, measured, strict=True)
        if ks is not None
    ]
    expected = replay(stretched, replace(uniform_setup, num_steps=6), "uniform")
    assert json.loads(out)["uniform"]["step_time_s"] == pytest.approx(expected.median_step_time_s)
    # The run directory works too, and --microbatches and --stages override the run's.
    rc, out, err = _cli(
        ["--from", str(tiny_run.parent), "--stages", "3", "--microbatches", "8"], capsys
    )
    assert rc == 0, err
    assert out.startswith("3 stages, 8 microbatches, 1f1b, 6 steps, load report every 2")


@pytest.mark.slow
def test_cli_refuses_a_truncated_run_log(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cut = tmp_path / "run.h5"
    data = tiny_run.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    line = _one_error_line(*_cli(["--from", str(cut)], capsys))
    assert str(cut) in line
