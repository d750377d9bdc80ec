"""How a stage waits for its neighbour: yield its core first, or sleep at once; pure.

A rank waiting for an activation or a gradient polls its MPI requests between back-off rounds
(:class:`dynmo_hpc.pipeline.comm.Backoff`). Sleeping between polls is what a rank must do when
ranks share cores: a spinning waiter would steal the core from a computing neighbour. But a sleep
ends late (the input is noticed up to half the last sleep after it arrived), and a rank that
sleeps lets its core go idle, so the next layer it runs starts on a core that may have halted
and whose caches other work may have used. When every rank on the host has a core of its own
there is no neighbour to steal from: the pipeline's waits then call ``sched_yield`` for their
first :data:`WAIT_YIELD_S`, and only a wait longer than that sleeps. What that does to step
times, on a static split (whose light stage waits the most) and a balanced one, is measured in
docs/benchmarks.md, "Pipeline wait mode".

``runtime.wait_mode``: ``auto`` (yield when each rank has a core of its own), ``yield``, ``sleep``.
The simulator models the same rule (:func:`dynmo_hpc.sim.wakeup.noticed_s`: a wait no longer
than the yield window is noticed at once).
"""

from __future__ import annotations

WAIT_YIELD_S = 5e-3
"""How long a pipeline wait yields its core before it sleeps, where ranks have cores of their
own. Longer than the waits of a balanced pipeline on the project's jobs (sub-millisecond to a
few milliseconds), short enough that a stage idle for a long time (an unbalanced split's light
stage) spends most of that time asleep."""

WAIT_MODES = ("auto", "yield", "sleep")


def has_own_core(ranks_on_host: int, affinity_cores: int, host_cores: int) -> bool:
    """Whether a rank may treat its core as its own while it waits.

    ``ranks_on_host``: the job's ranks on this host (MPI's shared-memory split);
    ``affinity_cores``: the cores this rank may run on (its affinity mask);
    ``host_cores``: the host's online cores. True when the ranks fit the cores this rank sees
    (no binding, enough cores), or when the launcher bound this rank to one core and the host
    has a core for every rank (``--bind-to core`` with one rank per core).
    """
    if min(ranks_on_host, affinity_cores, host_cores) < 1:
        raise ValueError(
            f"ranks_on_host={ranks_on_host}, affinity_cores={affinity_cores}, "
            f"host_cores={host_cores}: each must be >= 1"
        )
    if ranks_on_host <= affinity_cores:
        return True
    return affinity_cores == 1 and ranks_on_host <= host_cores


def pipeline_wait_yield_s(
    setting: str, ranks_on_host: int, affinity_cores: int, host_cores: int
) -> float:
    """Seconds a pipeline wait yields before it sleeps, for ``runtime.wait_mode = setting``."""
    if setting not in WAIT_MODES:
        raise ValueError(f"wait_mode={setting!r}; expected one of {WAIT_MODES}")
    if setting == "sleep":
        return 0.0
    if setting == "yield" or has_own_core(ranks_on_host, affinity_cores, host_cores):
        return WAIT_YIELD_S
    return 0.0
