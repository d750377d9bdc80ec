"""Scheme trajectories in the run log: ``scheme_stats`` counters become per-layer states, the
writer stores them in ``layer_states`` / ``expert_loads``, the reader gives them back, a run log
written before the tables existed still reads (and resumes), and a short real run records them."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import pytest

from dynmo_hpc.runlog import RunLogWriter, load, schema
from dynmo_hpc.runlog.trajectory import LayerState, layer_states
from tests.helpers.jobs import run_job
from tests.helpers.scheme_jobs import scheme_config, train_one_rank


def test_each_schemes_counters_become_fractions() -> None:
    detail = {
        "no_grad_below": 2,
        "layers": {
            "0": {"frozen": 1.0},
            "1": {"sparsity.neuron": 0.75, "sparsity.head": 0.5, "frozen": 1.0},
            "2": {"depth_router.processed": 64.0, "depth_router.tokens": 512.0},
            "3": {"attn.kept_blocks": 30.0, "attn.causal_blocks": 120.0, "attn.density": 0.9},
            "4": {
                "mlp.assignments": 200.0,
                "mlp.expert_0": 150.0,
                "mlp.expert_1": 40.0,
                "mlp.dropped": 10.0,
            },
            "5": {
                "processed": 100.0,
                "tokens": 400.0,
                "exit_head.reached": 100.0,
                "exit_head.exited": 60.0,
            },
        },
    }
    states = layer_states(detail, 7, top_k=2)
    assert [s.layer for s in states] == list(range(7))
    assert states[0].frozen_prefix and states[1].frozen_prefix and not states[2].frozen
    assert (states[1].neurons_kept, states[1].heads_kept) == (0.25, 0.5)
    assert states[2].tokens_kept == 0.125 and math.isnan(states[2].kv_tokens_kept)
    assert states[3].attention_density == 0.25  # measured pairs, not the configured 0.9
    # 200 assignments at top_k 2 = 100 tokens reached the layer.
    assert states[4].expert_loads == (1.5, 0.4)
    assert states[5].tokens_kept == 0.25 and states[5].kv_tokens_kept == 1.0
    assert states[5].exit_head
    # The head runs on what the last block left active: 100 - 60 of 400 tokens.
    assert states[6].tokens_kept == 0.1
    assert states[6].neurons_kept == 1.0 and states[6].expert_loads == ()


def _write(path: Path, states: list[LayerState]) -> None:
    with RunLogWriter(path, config_yaml="job: {name: t}\n", meta={}) as log:
        log.log_layer_states(step=4, states=states)
        log.log_layer_states(step=9, states=states[:2])


def test_layer_states_round_trip(tmp_path: Path) -> None:
    states = [
        LayerState(layer=0),
        LayerState(layer=1, neurons_kept=0.5, frozen=True, expert_loads=(0.7, 0.3)),
        LayerState(layer=2, tokens_kept=0.2, kv_tokens_kept=1.0, exit_head=True),
    ]
    _write(tmp_path / "run.h5", states)
    run = load(tmp_path / "run.h5")
    rows = run.layer_states
    assert rows["step"].tolist() == [4, 4, 4, 9, 9]
    assert rows["neurons_kept"].tolist()[:3] == [1.0, 0.5, 1.0]
    assert rows["frozen"].tolist()[:3] == [0, 1, 0]
    assert rows["exit_head"].tolist()[:3] == [0, 0, 1]
    assert rows["kv_tokens_kept"].isna().tolist()[:3] == [True, True, False]
    loads = run.expert_loads
    assert loads[["step", "layer", "expert"]].values.tolist() == [
        [4, 1, 0],
        [4, 1, 1],
        [9, 1, 0],
        [9, 1, 1],
    ]
    assert loads["load"].tolist() == [0.7, 0.3, 0.7, 0.3]


def test_a_log_without_the_tables_reads_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, [LayerState(layer=0)])
    with h5py.File(path, "a") as f:  # as a writer before the tables existed left it
        for name in schema.OPTIONAL_TABLES:
            del f[name]
    run = load(path)
    assert run.layer_states.empty and run.expert_loads.empty
    assert list(run.layer_states.columns) == list(schema.LAYER_STATES.dtype.names or ())
    with RunLogWriter(path, config_yaml="job: {name: t}\n", meta={}, resume=True) as log:
        log.log_layer_states(step=12, states=[LayerState(layer=0, tokens_kept=0.5)])
    again = load(path)
    assert again.layer_states["step"].tolist() == [12]
    assert again.layer_states["tokens_kept"].tolist() == [0.5]


@pytest.mark.parametrize("scheme", ["pruning", "early_exit", "moe"])
def test_a_real_run_records_what_its_scheme_stats_say(tmp_path: Path, scheme: str) -> None:
    cfg = scheme_config(tmp_path, scheme, "pipeline.num_stages=1")
    run = train_one_rank(cfg)
    log = load(cfg.run_dir / "run.h5")
    stats = [e for e in run.events if e["kind"] == "scheme_stats"]
    assert stats and sorted(log.layer_states["step"].unique()) == [e["step"] for e in stats]
    top_k = cfg.schemes.moe.top_k if cfg.schemes.moe is not None else 1
    last = stats[-1]
    want = layer_states(last, cfg.model.num_layers, top_k)
    got = log.layer_states[log.layer_states["step"] == last["step"]].sort_values("layer")
    assert got["neurons_kept"].tolist() == [s.neurons_kept for s in want]
    assert got["tokens_kept"].tolist() == [s.tokens_kept for s in want]
    if scheme == "pruning":
        assert min(got["neurons_kept"]) < 1.0  # the scheme acted and the log shows it
    if scheme == "early_exit":
        assert min(got["tokens_kept"]) < 1.0
    if scheme == "moe":
        loads = log.expert_loads[log.expert_loads["step"] == last["step"]]
        per_layer = loads.groupby("layer")["load"].sum()
        assert len(per_layer) >= 1 and all(0 < x <= top_k + 1e-9 for x in per_layer)


@pytest.mark.mpi
def test_rank_0_records_the_layers_of_every_stage(tmp_path: Path) -> None:
    cfg = scheme_config(tmp_path, "early_exit", "pipeline.num_stages=2")
    run_job(cfg)
    states = load(cfg.run_dir / "run.h5").layer_states
    last = states[states["step"] == states["step"].max()].sort_values("layer")
    assert last["layer"].tolist() == list(range(cfg.model.num_layers))  # both stages' layers
    tokens = last["tokens_kept"].tolist()
    assert tokens[0] == 1.0 and min(tokens) < 1.0
    assert tokens == sorted(tokens, reverse=True)  # tokens only ever exit
