"""Schedules are data: check every property exhaustively over small P and M."""

from __future__ import annotations

import pytest

from dynmo_hpc.pipeline.schedule import (
    build_schedule,
    gpipe,
    one_f_one_b,
    one_f_one_b_slack,
    theoretical_bubble_fraction,
)

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 13)]


@pytest.mark.parametrize("fn", [one_f_one_b, one_f_one_b_slack, gpipe])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_each_microbatch_one_forward_one_backward(fn, num_stages, num_microbatches):
    for stage in range(num_stages):
        actions = fn(stage, num_stages, num_microbatches)
        fwd = [a.microbatch for a in actions if a.kind == "F"]
        bwd = [a.microbatch for a in actions if a.kind == "B"]
        assert sorted(fwd) == list(range(num_microbatches))
        assert sorted(bwd) == list(range(num_microbatches))
        # A microbatch's backward comes after its forward on the same stage.
        position = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
        for m in range(num_microbatches):
            assert position[("F", m)] < position[("B", m)]
        # Backwards in microbatch order: gradients accumulate as in a single-process loop.
        assert bwd == list(range(num_microbatches))
        assert all(a.stage == stage for a in actions)


def simulate(fn, num_stages: int, num_microbatches: int) -> int:
    """Run all stages' action lists with blocking dependencies; return the number of rounds.

    F(s, m) needs F(s-1, m); B(s, m) needs B(s+1, m) (and F(s, m)). Raises on deadlock.
    """
    lists = [fn(s, num_stages, num_microbatches) for s in range(num_stages)]
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * num_stages
    rounds = 0
    while any(cursor[s] < len(lists[s]) for s in range(num_stages)):
        ready = []
        for s in range(num_stages):
            if cursor[s] == len(lists[s]):
                continue
            a = lists[s][cursor[s]]
            if a.kind == "F":
                ok = s == 0 or (s - 1, "F", a.microbatch) in done
            else:
                ok = (s, "F", a.microbatch) in done and (
                    s == num_stages - 1 or (s + 1, "B", a.microbatch) in done
                )
            if ok:
                ready.append((s, a))
        assert ready, f"deadlock: cursors {cursor}"
        for s, a in ready:
            done.add((s, a.kind, a.microbatch))
            cursor[s] += 1
        rounds += 1
    return rounds


@pytest.mark.parametrize("fn", [one_f_one_b, one_f_one_b_slack, gpipe])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_dependency_order_never_deadlocks(fn, num_stages, num_microbatches):
    rounds = simulate(fn, num_stages, num_microbatches)
    # With unit-time F and B, a flush schedule takes 2 * (M + P - 1) rounds.
    assert rounds == 2 * (num_microbatches + num_stages - 1)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_1f1b_bounds_in_flight_microbatches(num_stages, num_microbatches):
    for stage in range(num_stages):
        in_flight = peak = 0
        for a in one_f_one_b(stage, num_stages, num_microbatches):
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(num_stages - stage, num_microbatches)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_slack_runs_one_forward_ahead_on_all_but_the_last_stage(num_stages, num_microbatches):
    """Stage s < P-1 holds up to min(P - s + 1, M) microbatches (one more than 1F1B), the last
    stage 1; both schedules run the same backwards in the same order."""
    for stage in range(num_stages):
        in_flight = peak = 0
        actions = one_f_one_b_slack(stage, num_stages, num_microbatches)
        for a in actions:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        extra = 1 if stage < num_stages - 1 else 0
        assert peak == min(num_stages - stage + extra, num_microbatches)
        plain = one_f_one_b(stage, num_stages, num_microbatches)
        assert [a for a in actions if a.kind == "B"] == [a for a in plain if a.kind == "B"]


def test_docstring_example_and_lookup():
    assert [str(a) for a in one_f_one_b(0, 2, 3)] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert build_schedule("gpipe", 1, 2, 2) == gpipe(1, 2, 2)
    slack = [str(a) for a in build_schedule("1f1b-slack", 0, 2, 3)]
    assert slack == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build_schedule("zb", 0, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        one_f_one_b(3, 2, 2)
    assert theoretical_bubble_fraction(2, 8) == pytest.approx(1 / 9)


def test_memory_model_counts_the_slack_microbatch():
    """The packing and memory model hold what the schedule holds (stage 0 is the worst)."""
    from dynmo_hpc.balance.step_model import microbatches_in_flight

    for num_stages, num_microbatches in SIZES:
        worst = max(
            sum(
                1 if a.kind == "F" else -1
                for a in one_f_one_b_slack(0, num_stages, num_microbatches)[:k]
            )
            for k in range(2 * num_microbatches + 1)
        )
        assert microbatches_in_flight(num_stages, num_microbatches, "1f1b-slack") == worst
