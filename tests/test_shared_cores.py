"""The simulator with ranks sharing fewer cores than there are stages: hand-computed timelines,
the two limits (one core: the step is all the work; a core per stage: the plain simulation), and
the replay's split of a measured wall-per-CPU ratio into the sharing and the rest."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from dynmo_hpc.cli import main
from dynmo_hpc.sim.machine import MachineModel, load_machine, save_machine
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, external_wall_s_per_cpu_s, replay
from dynmo_hpc.sim.shared_cores import home_cores, placed_rates, shared_rate, shared_tail_s
from dynmo_hpc.sim.step import simulate_step
from dynmo_hpc.sim.wakeup import noticed_s


def test_shared_rate() -> None:
    assert shared_rate(1, 2) == shared_rate(2, 2) == 1.0
    assert shared_rate(4, 2) == 0.5
    assert shared_rate(3, 1.5) == 0.5


def test_gpipe_two_stages_one_core_hand_timeline() -> None:
    """GPipe, P=2, M=2, f=b=1, one core: F0 [0,1]; F1 on stage 0 and F0 on stage 1 share
    the core, both done at 3; stage 1's F1 [3,4], B0 [4,5]; its B1 shares with stage 0's B0
    [5,7]; stage 0's B1 [7,8]. A core per stage: 6."""
    assert simulate_step([1, 1], [1, 1], 2, "gpipe").step_time_s == 6.0
    result = simulate_step([1, 1], [1, 1], 2, "gpipe", cores=1)
    assert result.step_time_s == 8.0
    assert result.busy_s == [6.0, 6.0]  # wall seconds computing, the sharing included


def test_gpipe_one_core_with_latency_hand_timeline() -> None:
    """As above with 0.5 s per transfer. Stage 0: F0 [0,1], F1 from 1, alone until stage 1's
    input arrives at 1.5, then shared: done at 2.5. Stage 1: F0 from 1.5, shared until 2.5
    (0.5 done), alone to 3.0; F1 (input 2.5 + 0.5) [3,4], B0 [4,5], B1 from 5, alone to 5.5,
    shared with stage 0's B0 (input 5 + 0.5) until 6.5; stage 0's B0 alone to 7.0, B1 (input
    6.5 + 0.5) [7,8]."""
    result = simulate_step([1, 1], [1, 1], 2, "gpipe", comm_s=0.5, cores=1)
    assert result.step_time_s == pytest.approx(8.0)
    assert result.busy_s == pytest.approx([5.0, 5.0])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 1), (3, 4), (4, 4), (5, 9)])
def test_one_core_runs_all_the_work_back_to_back(
    schedule: str, num_stages: int, num_microbatches: int
) -> None:
    """Without latency some stage can always run, so one core is never idle: the step is the
    sum of every action's work and every tail."""
    rng = random.Random(num_stages * 100 + num_microbatches)
    fwd = [rng.uniform(0.1, 2.0) for _ in range(num_stages)]
    bwd = [rng.uniform(0.1, 4.0) for _ in range(num_stages)]
    tails = [rng.uniform(0.0, 1.0) for _ in range(num_stages)]
    result = simulate_step(
        fwd, bwd, num_microbatches, schedule, stage_overhead_s=tails, action_overhead_s=0.01,
        cores=1,
    )  # fmt: skip
    work = num_microbatches * (sum(fwd) + sum(bwd) + 2 * 0.01 * num_stages) + sum(tails)
    assert result.step_time_s == pytest.approx(work, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_core_per_stage_is_the_plain_simulation(schedule: str) -> None:
    rng = random.Random(7)
    for _ in range(20):
        p, m = rng.randint(1, 6), rng.randint(1, 9)
        fwd = [rng.uniform(0.1, 2.0) for _ in range(p)]
        bwd = [rng.uniform(0.1, 4.0) for _ in range(p)]
        kwargs = {"comm_s": rng.uniform(0, 0.3), "stage_overhead_s": [0.5] * p}
        plain = simulate_step(fwd, bwd, m, schedule, **kwargs)  # type: ignore[arg-type]
        for cores in (p, p + 0.5, 64):
            shared = simulate_step(fwd, bwd, m, schedule, cores=cores, **kwargs)  # type: ignore[arg-type]
            assert shared == plain


def test_sharing_lies_between_the_limits_and_the_bubble_gets_full_cores() -> None:
    """4 equal stages, 4 microbatches on 2 cores: slower than a core each, faster than the
    steady state's half a core stretched over the whole step (the bubble runs at full speed)."""
    fwd, bwd = [1.0] * 4, [2.0] * 4
    own = simulate_step(fwd, bwd, 4, "1f1b").step_time_s
    shared = simulate_step(fwd, bwd, 4, "1f1b", cores=2).step_time_s
    assert own < shared < 2 * own
    assert shared >= 4 * 4 * 3 / 2  # all the work over 2 cores


def test_shared_tails_hand_computed() -> None:
    """Tails 1, 2, 3 on 2 cores: a third each at 2/3 of a core until the first is done at
    1.5; then a core each: the second at 2.5, the third alone at 3.5."""
    assert shared_tail_s([2.0, 3.0, 1.0], 2).tolist() == pytest.approx([2.5, 3.5, 1.5])  # type: ignore[arg-type]
    assert shared_tail_s([2.0, 3.0, 1.0], 3).tolist() == [2.0, 3.0, 1.0]  # type: ignore[arg-type]


@pytest.mark.parametrize("cores", [0, -1, float("nan"), float("inf")])
def test_bad_cores_are_value_errors(cores: float) -> None:
    with pytest.raises(ValueError, match="cores="):
        simulate_step([1, 1], [1, 1], 2, cores=cores)
    with pytest.raises(ValueError, match="cores="):
        ReplaySetup(num_stages=2, num_microbatches=2, cores=cores).check()


def _report(k: float = 1.0) -> CostReport:
    return CostReport(
        forward_s=[1.0] * 8, backward_s=[2.0] * 8, num_params=[1] * 8, layer_bytes=[0] * 8,
        wall_s_per_cpu_s=k,
    )  # fmt: skip


def test_the_measured_ratio_keeps_only_what_sharing_does_not_explain() -> None:
    setup = ReplaySetup(num_stages=4, num_microbatches=4, cores=2)
    fwd, bwd = [0.5] * 4, [1.0] * 4  # 2 layers a stage, over 4 microbatches
    shared = simulate_step(fwd, bwd, 4, "1f1b", cores=2)
    own = sum(shared.busy_s) / (4 * (sum(fwd) + sum(bwd)))
    assert 1 < own < 2
    assert external_wall_s_per_cpu_s(fwd, bwd, 4, setup, own) == pytest.approx(1.0)
    assert external_wall_s_per_cpu_s(fwd, bwd, 4, setup, 3 * own) == pytest.approx(3.0)
    assert external_wall_s_per_cpu_s(fwd, bwd, 4, setup, 0.5) == 1.0  # faster than possible
    # The replay: a run that measured exactly the sharing replays as the shared simulation.
    result = replay([_report(own)], setup, "uniform")
    assert result.step_times_s == [pytest.approx(shared.step_time_s)] * 5
    # A core per stage ignores `cores` smaller than nothing: 2 stages on 2 cores is unshared.
    two = ReplaySetup(num_stages=2, num_microbatches=4, cores=2)
    assert replay([_report(1.5)], two, "uniform").step_times_s == [1.5 * 15.0] * 5


def test_machine_file_cores_and_cli_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = MachineModel(cores=2.0)
    save_machine(model, tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text()) == {
        "action_overhead_s": 0.0, "optimizer_s_per_param": 0.0, "step_overhead_s": 0.0,
        "report_overhead_s": 0.0, "cores": 2.0,
    }  # fmt: skip
    assert load_machine(tmp_path / "m.json") == model
    argv = ["simulate", "--costs", "1,1,1,1", "--stages", "4", "--microbatches", "4"]
    argv += ["--policies", "uniform", "--json"]
    outs = []
    for extra in ([], ["--cores", "2"], ["--machine", str(tmp_path / "m.json")], ["--cores", "4"]):
        assert main([*argv, *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out)["uniform"]["step_time_s"])
    unshared, two, from_file, four = outs
    assert two == from_file > unshared == four
    # --costs is forward + backward per layer and step, split 1:2, over 4 microbatches.
    assert two == pytest.approx(simulate_step([1 / 12] * 4, [1 / 6] * 4, 4, cores=2).step_time_s)
    (tmp_path / "bad.json").write_text('{"cores": 0}')
    with pytest.raises(ValueError, match=r"cores=0\.0 must be > 0"):
        load_machine(tmp_path / "bad.json")


def test_a_waiting_stage_notices_its_input_late() -> None:
    """The back-off: after a wait of w the input is noticed min(0.375 w, cap / 2) late; an
    input that was already there, at once."""
    ready = np.array([1.0, 0.5, 0.1, -np.inf, np.inf])
    free = np.array([0.0, 1.0, 0.0, 2.0, 0.0])
    assert noticed_s(ready, free, 0.2).tolist() == pytest.approx([1.1, 1.0, 0.1375, 2.0, np.inf])
    assert noticed_s(ready, free, 0.0).tolist() == [1.0, 1.0, 0.1, 2.0, np.inf]


@pytest.mark.parametrize("cores", [None, 1])
def test_wake_up_delay_hand_timeline(cores: float | None) -> None:
    """GPipe, P=2, M=1, f=b=1, cap 0.2 s: stage 1 waits 1 s for F0 and starts at 1.1; B0 ends at
    3.1; stage 0, free since 1, waited 2.1 s and starts B0 at 3.2: the step is 4.2 (4 without
    the back-off). Only one stage computes at a time, so one shared core changes nothing."""
    result = simulate_step([1, 1], [1, 1], 1, "gpipe", poll_max_s=0.2, cores=cores)
    assert result.step_time_s == pytest.approx(4.2)
    assert simulate_step([1, 1], [1, 1], 1, "gpipe", cores=cores).step_time_s == 4.0


def test_machine_file_poll_and_replay_use_it(tmp_path: Path) -> None:
    model = MachineModel(poll_max_s=1e-3, cores=2.0)
    save_machine(model, tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json") == model
    setup = ReplaySetup(num_stages=2, num_microbatches=1, schedule="gpipe", poll_max_s=0.2)
    report = CostReport(forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], num_params=[1, 1],
                        layer_bytes=[0, 0])  # fmt: skip
    assert replay([report], setup, "uniform").step_times_s == [pytest.approx(4.2)] * 5
    with pytest.raises(ValueError, match="poll_max_s"):
        simulate_step([1], [1], 1, poll_max_s=-1.0)


def test_home_cores_even_out_the_loads_heaviest_first() -> None:
    """0.06, 0.13, 0.20 on 2 cores: the heaviest alone, the two light ones together (the
    placement of the run that showed it: jobs/imbalanced.yaml on 3 stages)."""
    assert home_cores(np.array([0.06, 0.13, 0.20]), 2).tolist() == [1, 1, 0]  # type: ignore[union-attr]
    assert home_cores(np.array([1.0, 1.0, 1.0, 1.0]), 2).tolist() == [0, 1, 0, 1]  # type: ignore[union-attr]
    assert home_cores(np.array([1.0, 2.0]), 1.5) is None  # a fractional share: pooled


def test_placed_rates_share_a_core_and_give_idle_cores_away() -> None:
    home = np.array([1, 1, 0])
    all_run = np.array([True, True, True])
    assert placed_rates(all_run, home, 2).tolist() == [0.5, 0.5, 1.0]
    # the heaviest stage waits: its core is pulled over, the light ones get a core each
    assert placed_rates(np.array([True, True, False]), home, 2).tolist() == [1.0, 1.0, 0.0]
    four = np.array([0, 0, 0, 1])  # three on core 0, core 1's stage waits: 2/3 each
    rates = placed_rates(np.array([True, True, True, False]), four, 2)
    assert rates.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 0.0])
    assert placed_rates(all_run, None, 2).tolist() == pytest.approx([2 / 3] * 3)


@pytest.mark.parametrize("seed", range(5))
def test_placed_rates_never_idle_a_core_that_a_stage_could_use(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        p = int(rng.integers(2, 7))
        cores = int(rng.integers(1, p + 1))
        home = home_cores(rng.uniform(0.1, 1.0, p), cores)
        running = rng.random(p) < 0.6
        rates = placed_rates(running, home, cores)
        assert float(rates.sum()) == pytest.approx(min(int(running.sum()), cores))
        assert np.all(rates[running] > 0) and np.all(rates <= 1.0 + 1e-12)
        assert np.all(rates[~running] == 0)


def test_the_heaviest_of_three_stages_keeps_a_core_to_itself() -> None:
    """jobs/imbalanced.yaml on 3 stages, 2 cores (CPU seconds per microbatch from its run log):
    measured, the heaviest stage ran at the machine's external-load factor (its own core) and
    the light ones up to 1.5x; pooled cores (each of 3 busy stages at 2/3 of a core) made the
    heaviest 1.07x and the lightest 1.21x. Placed, the heaviest computes exactly its CPU time
    and the two light stages, sharing a core, are slower than pooled."""
    m = 6
    fwd = np.array([0.061, 0.125, 0.200]) / m / 3
    bwd = 2 * fwd
    result = simulate_step(fwd, bwd, m, "1f1b", cores=2)
    wall_per_cpu = np.array(result.busy_s) / (m * (fwd + bwd))
    assert wall_per_cpu[2] == pytest.approx(1.0)
    assert wall_per_cpu[0] > 1.3 and wall_per_cpu[1] > 1.15
