"""Peer check: the heaviest stage of our ``optimal`` against DeepSpeed's ``partition_balanced``.

Why: ``optimal`` claims the exact minimum of the heaviest stage's cost. The strongest outside
check is the partitioner that DeepSpeed's pipeline engine actually ships, run on the same cost
vectors and scored with the same arithmetic. Ours must never be heavier; where DeepSpeed's is
heavier, the table shows by how much. Not a test: DeepSpeed lives only in the benchmark env::

    make bench-env
    .venv-bench/bin/python benchmarks/peer_deepspeed.py                  # table + summary
    .venv-bench/bin/python benchmarks/peer_deepspeed.py --from runs/imbalanced/run.h5 --json

Vectors: seeded random families (uniform, lognormal, heavy-tailed Pareto, integers with ties,
uniform with zeros), adversarial ones (one huge layer, staircase, increasing, decreasing, ...),
DeepSpeed's own test cases, and with ``--from`` the measured per-layer costs of run logs (one
vector per load report: ``forward_s + backward_s`` per layer). Stage counts: 2, 4, 8, 16, 32,
those the layer count allows.

Both partitions are scored from one prefix-sum list (``dynmo_hpc.balance.common``), the
arithmetic ``optimal`` minimises exactly, so a float ulp cannot make ours look heavier.
DeepSpeed's boundaries are taken as returned (numpy ints become ints); an empty stage is
counted as a quirk, not rejected. Exit status: 0 when ours is never heavier, 1 otherwise, 2 when
DeepSpeed cannot be imported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_hpc.balance import partition
from dynmo_hpc.balance.common import loads_from_prefix, prefix_sums

STAGE_COUNTS = (2, 4, 8, 16, 32)
#: Layer counts of the generated vectors: a real model's size (10), non-powers of two, and 128,
#: where DeepSpeed's pure-Python O(P N^2) dynamic programme takes about a second at P = 32.
LAYER_COUNTS = (10, 24, 64, 128)

#: ``(weights, num_parts) -> boundaries``: DeepSpeed's signature, or a fake one in tests.
Partitioner = Callable[[list[float], int], Sequence[Any]]


@dataclass(frozen=True)
class Row:
    """One comparison: a cost vector on ``num_stages`` stages, both heaviest stages."""

    family: str
    vector: int
    """Index of the cost vector, so that one vector's stage counts can be grouped."""
    num_layers: int
    num_stages: int
    ours: float
    """Heaviest stage of ``partition(costs, P, "optimal")``."""
    peer: float
    """Heaviest stage of DeepSpeed's boundaries."""
    ours_parts: list[int]
    peer_parts: list[int]
    peer_empty_stages: int
    """Stages DeepSpeed left without a layer (ours never does)."""
    ours_s: float
    peer_s: float

    @property
    def ratio(self) -> float:
        """ours / peer: 1 when equal (both zero included), below 1 where DeepSpeed is heavier."""
        if self.ours == self.peer:
            return 1.0
        return math.inf if self.peer == 0 else self.ours / self.peer


def peer_boundaries(raw: Sequence[Any], num_layers: int, num_stages: int) -> tuple[list[int], int]:
    """DeepSpeed's result as plain ints, and its number of empty stages.

    Why checked here rather than trusted: the heaviest-stage score is only meaningful for a real
    contiguous cover of the layers, and DeepSpeed's older partitioners returned empty stages. A
    result that is not a cover at all (wrong length, out of range, decreasing) raises, because no
    score would be fair to it.
    """
    parts = [int(b) for b in raw]
    if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != num_layers:
        raise ValueError(
            f"peer returned {parts} for {num_layers} layers on {num_stages} stages; expected "
            f"{num_stages + 1} boundaries from 0 to {num_layers}"
        )
    if any(b < a for a, b in itertools.pairwise(parts)):
        raise ValueError(f"peer returned decreasing boundaries {parts}")
    return parts, sum(1 for a, b in itertools.pairwise(parts) if a == b)


def compare(
    family: str, costs: list[float], num_stages: int, peer: Partitioner, vector: int = 0
) -> Row:
    """Run both partitioners on ``costs`` and score them with one prefix-sum list."""
    prefix = prefix_sums(costs)
    t0 = time.perf_counter()
    ours_parts = partition(costs, num_stages, "optimal")
    t1 = time.perf_counter()
    raw = peer(list(costs), num_stages)
    t2 = time.perf_counter()
    peer_parts, empty = peer_boundaries(raw, len(costs), num_stages)
    return Row(
        family=family,
        vector=vector,
        num_layers=len(costs),
        num_stages=num_stages,
        ours=max(loads_from_prefix(prefix, ours_parts)),
        peer=max(loads_from_prefix(prefix, peer_parts)),
        ours_parts=ours_parts,
        peer_parts=peer_parts,
        peer_empty_stages=empty,
        ours_s=t1 - t0,
        peer_s=t2 - t1,
    )


def stage_counts(num_layers: int) -> list[int]:
    """The stage counts of :data:`STAGE_COUNTS` that leave every stage at least one layer."""
    return [p for p in STAGE_COUNTS if p <= num_layers]


def compare_all(vectors: Iterable[tuple[str, list[float]]], peer: Partitioner) -> list[Row]:
    """Every vector on every stage count it allows."""
    return [
        compare(family, costs, p, peer, vector)
        for vector, (family, costs) in enumerate(vectors)
        for p in stage_counts(len(costs))
    ]


def summarize(rows: Sequence[Row]) -> dict[str, Any]:
    """The figures the issue asks for, plus where and how much DeepSpeed is heavier."""
    vectors = {r.vector for r in rows}
    ratios = [r.ratio for r in rows]
    worst_peer = min(rows, key=lambda r: r.ratio, default=None)
    return {
        "vectors": len(vectors),
        "comparisons": len(rows),
        "max_ratio_ours_over_peer": max(ratios, default=math.nan),
        "min_ratio_ours_over_peer": min(ratios, default=math.nan),
        "ours_heavier": sum(1 for r in rows if r.ours > r.peer),
        "equal": sum(1 for r in rows if r.ours == r.peer),
        "peer_heavier": sum(1 for r in rows if r.peer > r.ours),
        "peer_with_empty_stages": sum(1 for r in rows if r.peer_empty_stages),
        "worst_peer_row": None if worst_peer is None else _row_dict(worst_peer),
        "by_family": by_family(rows),
        "ours_total_s": sum(r.ours_s for r in rows),
        "peer_total_s": sum(r.peer_s for r in rows),
    }


def family_group(family: str) -> str:
    """A family name without its seed (``#2``) or report step, so that seeds pool together."""
    name = family.split(" #", 1)[0]
    return name.split(" step ", 1)[0]


def by_family(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Per family group: comparisons, how many DeepSpeed loses, and its worst ratio."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(family_group(row.family), []).append(row)
    return {
        name: {
            "comparisons": len(group),
            "peer_heavier": sum(1 for r in group if r.peer > r.ours),
            "min_ratio_ours_over_peer": min(r.ratio for r in group),
        }
        for name, group in groups.items()
    }


def _row_dict(row: Row) -> dict[str, Any]:
    return {**asdict(row), "ratio": row.ratio}


# --- cost vectors ---------------------------------------------------------------------------


def random_vectors(
    seeds: int, layer_counts: Sequence[int] = LAYER_COUNTS
) -> Iterator[tuple[str, list[float]]]:
    """Seeded random families; seed ``s`` of family ``f`` at ``n`` layers is reproducible."""
    draws: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
        "uniform(0,1)": lambda g, n: g.random(n),
        "lognormal(s=1.5)": lambda g, n: g.lognormal(0.0, 1.5, n),
        "pareto(a=1.1)": lambda g, n: 1.0 + g.pareto(1.1, n),
        "ints 0..9": lambda g, n: g.integers(0, 10, n).astype(float),
        "uniform, 40% zeros": lambda g, n: np.where(g.random(n) < 0.4, 0.0, g.random(n)),
    }
    for index, (name, draw) in enumerate(draws.items()):
        for n in layer_counts:
            for seed in range(seeds):
                rng = np.random.default_rng([index, n, seed])
                yield f"{name} #{seed}", draw(rng, n).tolist()


def adversarial_vectors(
    layer_counts: Sequence[int] = LAYER_COUNTS,
) -> Iterator[tuple[str, list[float]]]:
    """Shapes chosen to trip heuristics: spikes, ramps, steps, ties and zero-cost runs."""
    shapes: dict[str, Callable[[int], list[float]]] = {
        "one huge layer first": lambda n: [float(n)] + [1.0] * (n - 1),
        "one huge layer middle": lambda n: [float(n) if i == n // 2 else 1.0 for i in range(n)],
        "one huge layer last": lambda n: [1.0] * (n - 1) + [float(n)],
        "staircase x2 (4 steps)": lambda n: [float(2 ** (4 * i // n)) for i in range(n)],
        "zeros then unit layers": lambda n: [0.0] * (n // 2) + [1.0] * (n - n // 2),
        "increasing 1..N": lambda n: [float(i + 1) for i in range(n)],
        "decreasing N..1": lambda n: [float(n - i) for i in range(n)],
        "geometric x1.2": lambda n: [1.2**i for i in range(n)],
        "alternating 10,1": lambda n: [10.0 if i % 2 == 0 else 1.0 for i in range(n)],
        "all equal": lambda n: [1.0] * n,
        "all zero": lambda n: [0.0] * n,
        "embed, blocks, heavy head": lambda n: [0.1] + [1.0] * (n - 2) + [float(n) / 4],
    }
    for name, shape in shapes.items():
        for n in layer_counts:
            yield name, shape(n)


def deepspeed_cases() -> Iterator[tuple[str, list[float]]]:
    """The vectors of DeepSpeed's own partitioning tests (also in docs/balancing.md)."""
    yield "DeepSpeed case [1]*8", [1.0] * 8
    yield "DeepSpeed case [0,1,2,3,3,3]", [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    yield "DeepSpeed case [0,1.1,30,3]", [0.0, 1.1, 30.0, 3.0]
    yield "DeepSpeed case [0,1.1,1.9,3,30]", [0.0, 1.1, 1.9, 3.0, 30.0]


def run_log_vectors(paths: Sequence[Path]) -> Iterator[tuple[str, list[float]]]:
    """One vector per load report of each run log: ``forward_s + backward_s`` per layer."""
    from dynmo_hpc.runlog import load  # h5py only when --from is given

    for path in paths:
        table = load(path).layer_costs
        label = f"{path.parent.name}/{path.name}"
        for step, report in table.groupby("step", sort=True):
            report = report.sort_values("layer")
            costs = (report["forward_s"] + report["backward_s"]).astype(float).tolist()
            yield f"run log {label} step {int(step)}", costs


# --- DeepSpeed and output -------------------------------------------------------------------


def load_deepspeed() -> tuple[Partitioner, str]:
    """DeepSpeed's ``partition_balanced`` and DeepSpeed's version, imported for the CPU.

    ``DS_ACCELERATOR=cpu`` skips the accelerator probe (and its warning) on a machine without a
    GPU; the benchmark only calls a pure-Python function, so the accelerator is irrelevant.
    Raises ImportError outside the benchmark env.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.utils import partition_balanced

    return partition_balanced, str(deepspeed.__version__)


def _format_table(rows: Sequence[Row]) -> list[str]:
    head = f"{'family':<42} {'N':>4} {'P':>3} {'ours':>12} {'DeepSpeed':>12} {'ratio':>7}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        notes = []
        if r.peer > r.ours:
            notes.append(f"DS +{(r.peer / r.ours - 1) * 100:.1f}%" if r.ours else "DS heavier")
        if r.ours > r.peer:
            notes.append("OURS HEAVIER")
        if r.peer_empty_stages:
            notes.append(f"DS {r.peer_empty_stages} empty stage(s)")
        lines.append(
            f"{r.family:<42} {r.num_layers:>4} {r.num_stages:>3} {r.ours:>12.6g} "
            f"{r.peer:>12.6g} {r.ratio:>7.4f}  {', '.join(notes)}"
        )
    return lines


def _format_summary(summary: dict[str, Any], version: str) -> list[str]:
    head = f"{'family group':<42} {'runs':>5} {'DS heavier':>10} {'min ratio':>9}"
    lines = [head, "-" * len(head)]
    for name, group in summary["by_family"].items():
        lines.append(
            f"{name:<42} {group['comparisons']:>5} {group['peer_heavier']:>10} "
            f"{group['min_ratio_ours_over_peer']:>9.4f}"
        )
    lines += [
        "",
        f"DeepSpeed {version} partition_balanced vs dynmo_hpc optimal",
        f"vectors: {summary['vectors']}, comparisons (vector x P): {summary['comparisons']}",
        f"max ratio ours/DS: {summary['max_ratio_ours_over_peer']:.6f} "
        f"(min {summary['min_ratio_ours_over_peer']:.6f})",
        f"ours heavier: {summary['ours_heavier']}, equal: {summary['equal']}, "
        f"DS heavier: {summary['peer_heavier']}, DS with empty stages: "
        f"{summary['peer_with_empty_stages']}",
        f"partitioner time, all comparisons: ours {summary['ours_total_s']:.3f} s, "
        f"DS {summary['peer_total_s']:.3f} s",
    ]
    worst = summary["worst_peer_row"]
    if worst is not None and worst["ratio"] < 1.0:
        lines.append(
            f"largest DS excess: {worst['family']} N={worst['num_layers']} "
            f"P={worst['num_stages']}: ours {worst['ours']:.6g} {worst['ours_parts']}, "
            f"DS {worst['peer']:.6g} {worst['peer_parts']}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="vectors per random family and N")
    parser.add_argument(
        "--from",
        dest="run_logs",
        type=Path,
        nargs="+",
        default=[],
        metavar="RUN.h5",
        help="add the per-layer costs of these run logs (one vector per load report)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)

    try:
        peer, version = load_deepspeed()
    except ImportError as exc:
        print(
            f"error: DeepSpeed is not importable here ({exc}); run `make bench-env` and use "
            ".venv-bench/bin/python",
            file=sys.stderr,
        )
        return 2

    vectors: list[tuple[str, list[float]]] = [
        *deepspeed_cases(),
        *adversarial_vectors(),
        *random_vectors(args.seeds),
        *run_log_vectors(args.run_logs),
    ]
    rows = compare_all(vectors, peer)
    summary = summarize(rows)
    if args.json:
        out = {
            "deepspeed_version": version,
            "summary": summary,
            "rows": [_row_dict(r) for r in rows],
        }
        print(json.dumps(out, indent=1))
    else:
        print("\n".join([*_format_table(rows), "", *_format_summary(summary, version)]))
    return 1 if summary["ours_heavier"] else 0


if __name__ == "__main__":
    sys.exit(main())
