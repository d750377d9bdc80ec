"""benchmarks/peer_deepspeed.py's comparison helpers, with fake partitioners instead of DeepSpeed.

Why fakes: DeepSpeed lives only in .venv-bench (``make bench-env``), and the main suite must not
need it. What can break without DeepSpeed is the scoring and the gate: that both partitions are
scored with the same arithmetic, that empty or malformed peer results are caught, that only the
stage counts a vector allows are run, and that the script fails when ours is heavier.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import pytest

from dynmo_hpc.balance import optimal, uniform
from tests.helpers.jobs import ROOT


def _load_script() -> ModuleType:
    path = ROOT / "benchmarks" / "peer_deepspeed.py"
    spec = importlib.util.spec_from_file_location("peer_deepspeed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


peer = _load_script()


def _numpy_uniform(weights: list[float], num_parts: int) -> list[object]:
    """A fake peer shaped like DeepSpeed's result: numpy ints, then a plain int at the end."""
    parts: list[object] = [np.int64(b) for b in uniform(weights, num_parts)[:-1]]
    return [*parts, len(weights)]


def test_compare_scores_both_with_the_same_loads() -> None:
    costs = [1.0, 5.0, 2.0, 3.0]
    row = peer.compare("fake", costs, 3, _numpy_uniform, vector=7)
    assert row.ours_parts == [0, 1, 2, 4] and row.ours == 5.0
    assert row.peer_parts == [0, 1, 2, 4] and all(type(b) is int for b in row.peer_parts)
    assert (row.peer, row.ratio, row.vector, row.peer_empty_stages) == (5.0, 1.0, 7, 0)

    row = peer.compare("fake", [4.0, 1.0, 1.0, 1.0, 1.0], 2, _numpy_uniform)
    assert (row.ours, row.peer) == (4.0, 5.0)  # uniform puts 4+1 on stage 0
    assert row.ratio == pytest.approx(0.8)


def test_peer_boundaries_counts_empty_stages_and_rejects_non_covers() -> None:
    assert peer.peer_boundaries([0, 1, 2, 2, 2], 2, 4) == ([0, 1, 2, 2, 2], 2)
    with pytest.raises(ValueError, match="expected 5 boundaries"):
        peer.peer_boundaries([0, 1, 2], 2, 4)
    with pytest.raises(ValueError, match="from 0 to 6"):
        peer.peer_boundaries([0, 3, 5], 6, 2)
    with pytest.raises(ValueError, match="decreasing"):
        peer.peer_boundaries([0, 4, 3, 6], 6, 3)


def test_compare_all_runs_only_the_stage_counts_a_vector_allows() -> None:
    rows = peer.compare_all([("a", [1.0] * 10), ("b", [1.0] * 3)], optimal)
    assert [(r.vector, r.num_stages) for r in rows] == [(0, 2), (0, 4), (0, 8), (1, 2)]
    summary = peer.summarize(rows)
    assert (summary["vectors"], summary["comparisons"], summary["equal"]) == (2, 4, 4)
    assert summary["ours_heavier"] == 0 and summary["max_ratio_ours_over_peer"] == 1.0


def test_summary_counts_where_each_side_is_heavier() -> None:
    rows = [
        peer.compare("fake", [4.0, 1.0, 1.0, 1.0, 1.0], 2, _numpy_uniform, vector=0),
        peer.compare("zero", [0.0, 0.0, 0.0], 2, _numpy_uniform, vector=1),
    ]
    summary = peer.summarize(rows)
    assert (summary["peer_heavier"], summary["equal"], summary["ours_heavier"]) == (1, 1, 0)
    assert summary["min_ratio_ours_over_peer"] == pytest.approx(0.8)
    assert summary["worst_peer_row"]["family"] == "fake"
    assert summary["by_family"]["fake"] == {
        "comparisons": 1,
        "peer_heavier": 1,
        "min_ratio_ours_over_peer": pytest.approx(0.8),
    }


def test_family_group_pools_seeds_and_report_steps() -> None:
    assert peer.family_group("lognormal(s=1.5) #2") == "lognormal(s=1.5)"
    assert peer.family_group("run log imbalanced/run.h5 step 14") == "run log imbalanced/run.h5"
    assert peer.family_group("one huge layer first") == "one huge layer first"


def _patch_peer(monkeypatch: pytest.MonkeyPatch, fake: object) -> None:
    monkeypatch.setattr(peer, "load_deepspeed", lambda: (fake, "fake-0"))


def test_main_passes_when_ours_is_never_heavier(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _patch_peer(monkeypatch, _numpy_uniform)
    assert peer.main(["--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed fake-0 partition_balanced" in out and "ours heavier: 0," in out


def test_main_fails_when_ours_is_heavier(monkeypatch: pytest.MonkeyPatch) -> None:
    # Swap roles: "ours" becomes the uniform split and the fake peer the exact optimum.
    def ours_uniform(costs: Sequence[float], num_stages: int, algorithm: str) -> list[int]:
        return uniform(costs, num_stages)

    _patch_peer(monkeypatch, optimal)
    monkeypatch.setattr(peer, "partition", ours_uniform)
    assert peer.main(["--seeds", "1", "--json"]) == 1


def test_main_says_how_to_get_deepspeed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'deepspeed'")

    monkeypatch.setattr(peer, "load_deepspeed", missing)
    assert peer.main([]) == 2
    assert "make bench-env" in capsys.readouterr().err
