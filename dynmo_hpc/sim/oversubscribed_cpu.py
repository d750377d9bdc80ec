"""A layer's CPU seconds when the ranks outnumber the cores: measured on one stage count, used
on another.

A load report holds each layer's *thread CPU* seconds. With more ranks than cores the ranks
take turns on the cores and the scheduler moves them between cores; every switch refills the
caches, so the same layer takes more CPU seconds than in a run with a core per rank, on every
layer, including the layers of a stage heavy enough to have a core mostly to itself (measured:
docs/simulate.md, "The machine calibration"). A held-out
prediction that changes whether the ranks outnumber the cores (a 2-stage run predicting a
3-stage run on 2 cores, a 4-stage run predicting the 2 stages it packs onto) must take that out
of the source's costs and put it into the target's steps; the replay's other factors (the
simulated sharing of the cores, the machine's ``oversubscribed_wall_s_per_cpu_s``) are about
wall time and cannot.

The factor is fitted on calibration runs (:func:`fit_oversubscribed_cpu`), never on the runs it
predicts, and applied by :func:`alone_costs` (the source side) and the replay's
``ReplaySetup.oversubscribed_cpu_s_per_cpu_s`` (the target side).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import replace

from dynmo_hpc.sim.replay import CostReport
from dynmo_hpc.sim.runlog_traces import RunTraces


def alone_costs(traces: RunTraces, cores: float | None, factor: float | None) -> list[CostReport]:
    """``traces``' reports, those measured on more stages than ``cores`` divided by ``factor``:
    what the layers cost with a core per rank. Unchanged without ``cores`` or a factor."""
    if cores is None or factor is None:
        return list(traces.reports)
    return [
        replace(
            report,
            forward_s=[x / factor for x in report.forward_s],
            backward_s=[x / factor for x in report.backward_s],
        )
        if len(parts) - 1 > cores
        else report
        for report, parts in zip(traces.reports, traces.report_parts, strict=True)
    ]


def fit_oversubscribed_cpu(runs: Sequence[tuple[RunTraces, str]], cores: float) -> float | None:
    """The oversubscribed CPU factor from calibration runs: ``(traces, job key)`` pairs, where
    the job key names what makes layer costs comparable (model, schemes, micro batch).

    For every job with runs on no more stages than ``cores`` (*alone*) and on more (*shared*),
    for every such pair of runs and every load report step both logged: the shared run's CPU
    seconds per microbatch over all layers, over the alone run's. The median over all of them;
    None when no job has both kinds of run. A factor below 1 would be measured, and kept."""
    by_job: dict[str, list[RunTraces]] = {}
    for traces, job in runs:
        by_job.setdefault(job, []).append(traces)
    ratios: list[float] = []
    for group in by_job.values():
        alone = [t for t in group if t.num_stages <= cores]
        shared = [t for t in group if t.num_stages > cores]
        for a, s in itertools.product(alone, shared):
            ratios += _report_ratios(a, s)
    return float(statistics.median(ratios)) if ratios else None


def _per_microbatch_s(report: CostReport, num_microbatches: int) -> float:
    return (sum(report.forward_s) + sum(report.backward_s)) / num_microbatches


def _report_ratios(alone: RunTraces, shared: RunTraces) -> list[float]:
    """Per report step both runs logged: the layers' CPU seconds per microbatch, shared run
    over alone run."""
    alone_at = dict(zip(alone.report_steps, alone.reports, strict=True))
    out = []
    for step, report in zip(shared.report_steps, shared.reports, strict=True):
        other = alone_at.get(step)
        if other is None:
            continue
        den = _per_microbatch_s(other, alone.num_microbatches)
        if den > 0:
            out.append(_per_microbatch_s(report, shared.num_microbatches) / den)
    return out
