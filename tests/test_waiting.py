"""How a stage waits: yield while each rank has a core of its own, else sleep at once.

Pure rule (:mod:`dynmo_hpc.pipeline.waiting`), the back-off that applies it, the link the
trainer builds with it, the config key, and the simulator's model of the same rule.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from mpi4py import MPI

from dynmo_hpc import config as config_mod
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.pipeline import comm as comm_mod
from dynmo_hpc.pipeline.comm import Backoff, make_link
from dynmo_hpc.pipeline.groups import make_groups
from dynmo_hpc.pipeline.waiting import WAIT_YIELD_S, has_own_core, pipeline_wait_yield_s
from dynmo_hpc.sim.step import simulate_step
from dynmo_hpc.sim.wakeup import noticed_s

DEFAULT_JOB = "jobs/default.yaml"


@pytest.mark.parametrize(
    ("ranks", "affinity", "host", "own"),
    [
        (2, 2, 2, True),  # unbound, one core each
        (1, 4, 4, True),
        (2, 1, 2, True),  # --bind-to core, one rank per core
        (3, 2, 2, False),  # oversubscribed, unbound
        (3, 1, 2, False),  # bound but more ranks than the host's cores
        (4, 2, 8, False),  # a cgroup narrows the job to 2 of 8 cores
    ],
)
def test_own_core(ranks: int, affinity: int, host: int, own: bool) -> None:
    assert has_own_core(ranks, affinity, host) is own
    expected = WAIT_YIELD_S if own else 0.0
    assert pipeline_wait_yield_s("auto", ranks, affinity, host) == expected
    assert pipeline_wait_yield_s("yield", ranks, affinity, host) == WAIT_YIELD_S
    assert pipeline_wait_yield_s("sleep", ranks, affinity, host) == 0.0


def test_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="wait_mode='sometimes'"):
        pipeline_wait_yield_s("sometimes", 2, 2, 2)
    with pytest.raises(ValueError, match="ranks_on_host=0"):
        has_own_core(0, 2, 2)


def test_backoff_yields_for_its_window_then_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A back-off with a yield window calls sched_yield until the window has passed, and only
    then sleeps; without one it sleeps on the first idle round."""
    clock = {"now": 0.0}
    calls: list[str] = []
    monkeypatch.setattr(comm_mod.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(comm_mod.os, "sched_yield", lambda: calls.append("yield"))
    monkeypatch.setattr(comm_mod.time, "sleep", lambda s: calls.append(f"sleep {s:g}"))
    backoff = Backoff(max_sleep_s=1e-3, yield_s=2e-3)
    for now in (0.0, 1e-3, 1.9e-3, 2.1e-3, 2.2e-3):
        clock["now"] = now
        backoff.round(False)
    assert calls == ["yield", "yield", "yield", "sleep 2e-05", "sleep 4e-05"]
    calls.clear()
    Backoff(max_sleep_s=1e-3).round(False)
    assert calls == ["sleep 2e-05"]


@pytest.mark.parametrize(("spin", "expected"), [("auto", WAIT_YIELD_S), ("yield", WAIT_YIELD_S),
                                                ("sleep", 0.0)])  # fmt: skip
def test_the_trainer_link_carries_the_rule(spin: str, expected: float) -> None:
    """One rank alone on its host (COMM_SELF) has a core of its own: ``auto`` yields."""
    groups = make_groups(MPI.COMM_SELF, 1, 1)
    assert groups.ranks_on_host == 1
    runtime = dataclasses.replace(config_mod.load(DEFAULT_JOB).runtime, wait_mode=spin, p2p="mpi")
    link = make_link(runtime, groups, torch.device("cpu"))
    assert link.wait_yield_s == expected


def test_config_key() -> None:
    assert config_mod.load(DEFAULT_JOB).runtime.wait_mode == "auto"
    assert config_mod.load(DEFAULT_JOB, ["runtime.wait_mode=sleep"]).runtime.wait_mode == "sleep"
    with pytest.raises(ConfigError, match="wait_mode"):
        config_mod.load(DEFAULT_JOB, ["runtime.wait_mode=sometimes"])


def test_simulated_wait_yields_then_sleeps() -> None:
    """Cap 0.2 s, yield window 0.5 s: a 0.4 s wait is noticed at once; a 1 s wait sleeps for
    0.5 s of it and is noticed min(0.375 * 0.5, 0.1) = 0.1 s late."""
    ready = np.array([0.4, 1.0, 0.1])
    free = np.zeros(3)
    assert noticed_s(ready, free, 0.2, 0.5).tolist() == pytest.approx([0.4, 1.1, 0.1])
    assert noticed_s(ready, free, 0.2).tolist() == pytest.approx([0.5, 1.1, 0.1375])


def test_simulated_step_yields_only_where_stages_have_their_own_core() -> None:
    """GPipe, P=2, M=1, f=b=1, cap 0.2 s (the hand timeline of test_shared_cores: 4.2 s with
    late wake-ups). With a 5 s yield window and a core per stage the waits cost nothing (4.0);
    on one shared core the stages sleep as ``auto`` makes them, so the window is not applied."""
    own = simulate_step([1, 1], [1, 1], 1, "gpipe", poll_max_s=0.2, poll_yield_s=5.0)
    assert own.step_time_s == pytest.approx(4.0)
    shared = simulate_step([1, 1], [1, 1], 1, "gpipe", poll_max_s=0.2, poll_yield_s=5.0, cores=1)
    assert shared.step_time_s == pytest.approx(4.2)
    with pytest.raises(ValueError, match="poll_yield_s"):
        simulate_step([1], [1], 1, poll_yield_s=-1.0)


def test_a_part_of_a_launch_counts_the_whole_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job trained on a part of a 4-rank launch (COMM_SELF here) shares the host with the
    launch's other ranks: the launcher's local size counts, and ``auto`` then sleeps on a host
    with fewer cores."""
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4096")
    groups = make_groups(MPI.COMM_SELF, 1, 1)
    assert groups.ranks_on_host == 4096
    runtime = config_mod.load(DEFAULT_JOB).runtime
    link = make_link(dataclasses.replace(runtime, p2p="mpi"), groups, torch.device("cpu"))
    assert link.wait_yield_s == 0.0
