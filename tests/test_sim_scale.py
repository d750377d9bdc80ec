"""A run's scheme trajectory on a larger model (:mod:`dynmo_hpc.sim.scale`), ``dynmo-hpc
simulate --model`` on a tiny real run with its error paths, and the pure parts of
``benchmarks/sim_scale.py`` (the mapping per job, the table's columns, the generated-section
markers)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dynmo_hpc.cli import main
from dynmo_hpc.sim.cost_model import LayerShape, SchemeState, layer_cost, layer_times_s
from dynmo_hpc.sim.machine import LayerRates, MachineModel, save_machine
from dynmo_hpc.sim.replay import ReplaySetup
from dynmo_hpc.sim.scale import (
    Trajectory,
    layer_params,
    map_states,
    price_report,
    scale_reports,
    simulate_stages,
    source_blocks,
    speedup,
)
from dynmo_hpc.sim.scale_limits import STATIC_BASELINES
from tests.helpers.jobs import ROOT
from tests.helpers.scheme_jobs import scheme_config, train_one_rank

RATES = LayerRates(flops_per_s=1e12, bytes_per_s=1e11, overhead_s=1e-5)


def _shapes(blocks: int, d_model: int = 64) -> list[LayerShape]:
    common = {"d_model": d_model, "num_heads": 4, "seq_len": 64, "micro_batch": 1}
    return [
        LayerShape(kind="embedding", **common),
        *(LayerShape(kind="block", d_ff=4 * d_model, **common) for _ in range(blocks)),
        LayerShape(kind="head", **common),
    ]


# --- mapping (pure, synthetic) -----------------------------------------------------------------


def test_blocks_map_by_relative_depth_or_periodically() -> None:
    assert source_blocks(4, 8, "depth") == [0, 0, 1, 1, 2, 2, 3, 3]
    assert source_blocks(3, 4, "depth") == [0, 0, 1, 2]
    assert source_blocks(4, 8, "periodic") == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="HINT: choose one of depth, periodic"):
        source_blocks(4, 8, "sideways")


def test_a_frozen_prefix_stays_a_prefix_and_edges_keep_their_state() -> None:
    frozen = SchemeState(frozen=True, frozen_prefix=True)
    head = SchemeState(tokens_kept=0.5)
    states = [frozen, frozen, SchemeState(), SchemeState(), SchemeState(), head]  # 4 blocks
    mapped = map_states(states, 12)
    assert len(mapped) == 14 and mapped[0] is frozen and mapped[-1] is head
    flags = [s.frozen_prefix for s in mapped[1:-1]]
    assert flags == [True] * 3 + [False] * 9  # block 1 of 4 -> blocks 1-3 of 12


def test_an_exit_head_stays_one_head_at_its_relative_depth() -> None:
    exit_block = SchemeState(exit_head=True, tokens_kept=0.5, kv_tokens_kept=1.0)
    states = [SchemeState(), SchemeState(), exit_block, SchemeState(), SchemeState()]  # 3 blocks
    mapped = map_states(states, 9)[1:-1]
    assert [s.exit_head for s in mapped] == [False] * 5 + [True] + [False] * 3
    assert [s.tokens_kept for s in mapped[3:6]] == [0.5] * 3  # the tokens still stretch
    assert sum(s.exit_head for s in map_states(states, 9, "periodic")) == 3


def test_pricing_follows_the_state() -> None:
    shapes = _shapes(2)
    pruned = SchemeState(neurons_kept=0.25, heads_kept=0.5)
    report = price_report(shapes, [SchemeState(), SchemeState(), pruned, SchemeState()], RATES, 8)
    f_dense, b_dense = layer_times_s(layer_cost(shapes[1]), RATES)
    assert report.forward_s[1] == pytest.approx(8 * f_dense)
    assert report.backward_s[1] == pytest.approx(8 * b_dense)
    assert report.forward_s[2] < report.forward_s[1]  # the pruned block is cheaper
    assert report.num_params[2] < report.num_params[1]
    # 12 d^2 + 4d (LayerNorms) + biases (3d + d + d_ff + d) for a dense GPT block.
    d = 64
    assert layer_params(shapes[1], SchemeState()) == 12 * d * d + 4 * d + 3 * d + d + 4 * d + d
    assert report.layer_bytes[1] == 16 * report.num_params[1]


def test_the_larger_model_gets_moe_width_and_padding() -> None:
    moe = SchemeState(expert_loads=(0.9, 0.1))
    traj = Trajectory(steps=[4], states=[[SchemeState(), moe, SchemeState(), SchemeState()]])
    shapes = _shapes(4)
    gather = scale_reports(traj, shapes, RATES, 4)[0]
    padded = scale_reports(traj, shapes, RATES, 4, padded=True)[0]
    wide = scale_reports(traj, shapes, RATES, 4, expert_d_ff=1024)[0]
    # Blocks 1-2 of 4 map to the run's MoE block 1; 3-4 to its dense block 2.
    assert padded.forward_s[1] > gather.forward_s[1] and padded.forward_s[3] == gather.forward_s[3]
    assert wide.forward_s[2] > gather.forward_s[2]


# --- speedups ----------------------------------------------------------------------------------


def test_speedup_is_the_median_ratio_and_the_steady_maximum() -> None:
    s = speedup([4.0, 4.0, 4.0, 4.0], [4.0, 2.0, 2.0, 1.0], steady_from=2)
    assert s.median == 2.0  # median 4 / median 2
    assert s.steady_max == 4.0  # steps 2 and 3: 2x and 4x
    with pytest.raises(ValueError, match="same, non-zero number"):
        speedup([1.0], [1.0, 2.0], 0)


def _imbalanced_trajectory(blocks: int) -> Trajectory:
    """The first half of the blocks keeps 10 % of its neurons and heads from report 1 on."""
    dense = [SchemeState()] * (blocks + 2)
    pruned = list(dense)
    for i in range(1, blocks // 2 + 1):
        pruned[i] = SchemeState(neurons_kept=0.1, heads_kept=0.25)
    return Trajectory(steps=[4, 9, 14, 19], states=[dense, pruned, pruned, pruned])


def test_megatron_and_parameters_speedups_on_an_imbalanced_trajectory() -> None:
    reports = scale_reports(_imbalanced_trajectory(8), _shapes(16), RATES, 8)
    setup = ReplaySetup(num_stages=4, num_microbatches=8, interval=5, num_steps=20, margin=0.0)
    result = simulate_stages(reports, setup, ["optimal"], steady_from_step=5)
    mg = result.speedups["megatron"]["megatron"]
    assert (mg.median, mg.steady_max) == (1.0, 1.0)  # a baseline against itself
    optimal = result.speedups["optimal"]
    assert optimal["megatron"].steady_max > 1.1  # the pruned half is cheap: rebalancing pays
    assert optimal["parameters"].steady_max > 1.0
    lim = result.limits
    assert lim is not None and lim.best_balancer == "optimal"
    assert lim.ceiling > optimal[lim.best_static].steady_max * 0.9
    product = lim.imbalance * lim.granularity * lim.pipeline * lim.decisions * lim.migrations
    assert product == pytest.approx(lim.achieved)
    assert lim.decisions <= 1.0 + 1e-12  # the partitions it ran are among the ceiling's
    assert set(result.median_step_s) == {"megatron", "uniform", "parameters", "profiled", "optimal"}
    assert set(result.speedups["optimal"]) == {"megatron", "uniform", "parameters", "profiled"}


def test_a_plain_trajectory_gains_nothing_over_megatron_at_even_splits() -> None:
    plain = Trajectory(steps=[4, 9], states=[[SchemeState()] * 18] * 2)
    reports = scale_reports(plain, _shapes(16), RATES, 8)
    setup = ReplaySetup(num_stages=4, num_microbatches=8, interval=5, margin=0.0)
    result = simulate_stages(reports, setup, ["optimal"], steady_from_step=0)
    # Only the embedding and the head differ: at most a few per cent either way.
    assert 0.9 < result.speedups["optimal"]["megatron"].median < 1.1
    assert result.block_spread == pytest.approx(1.0)


# --- the CLI on a tiny real run ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("scale")
    cfg = scheme_config(tmp, "pruning", "pipeline.num_stages=1", "train.steps=6")
    train_one_rank(cfg)
    machine = tmp / "machine.json"
    save_machine(MachineModel(layer_rates=RATES), machine)
    model = tmp / "model.yaml"
    model.write_text(
        "job: {name: big}\nmodel: {num_blocks: 16, d_model: 128, num_heads: 4, d_ff: 512, "
        "seq_len: 64}\ntrain: {micro_batch_size: 1, num_microbatches: 8}\n"
    )
    return cfg.run_dir / "run.h5", model, machine


def test_cli_prints_speedups_per_stage_count(
    tiny_run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run, model, machine = tiny_run
    argv = ["simulate", "--from", str(run), "--model", str(model), "--stages", "2,4"]
    rc = main([*argv, "--machine", str(machine), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["blocks"] == 16 and out["microbatches"] == 8
    assert [r["stages"] for r in out["results"]] == [2, 4]
    for r in out["results"]:
        assert set(r["speedup"]) == {
            "megatron",
            "parameters",
            "profiled",
            "uniform",
            "optimal",
            "diffusion",
        }
        assert r["speedup"]["megatron"]["megatron"]["median"] == 1.0
        assert r["speedup"]["optimal"]["parameters"]["steady_max"] > 0
    rc = main([*argv, "--machine", str(machine)])
    text = capsys.readouterr().out
    assert rc == 0 and "/megatron med" in text and "optimal" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stages", "2"], "--model needs --machine"),
        (["--stages", "40", "--machine", "MACHINE"], "--stages 40 > the model's 18 layers"),
        (["--stages", "2", "--machine", "EMPTY"], "has no layer_\\* rates"),
    ],
)
def test_cli_error_paths(
    tiny_run: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    run, model, machine = tiny_run
    empty = tmp_path / "empty.json"
    save_machine(MachineModel(), empty)
    extra = [str(machine) if x == "MACHINE" else str(empty) if x == "EMPTY" else x for x in extra]
    rc = main(["simulate", "--from", str(run), "--model", str(model), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "HINT:" in err
    assert __import__("re").search(message, err), err


def test_a_stage_list_needs_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--costs", "1,2,3,4", "--stages", "2,4", "--microbatches", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "a list needs --model" in err and "HINT:" in err


# --- benchmarks/sim_scale.py -------------------------------------------------------------------


def _script() -> ModuleType:
    path = ROOT / "benchmarks" / "sim_scale.py"
    spec = importlib.util.spec_from_file_location("sim_scale", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_scale"] = module
    spec.loader.exec_module(module)
    return module


sim_scale = _script()


@pytest.mark.parametrize(
    ("job", "mapping"),
    [
        ("natural/mod", "periodic"),
        ("natural/moe", "periodic"),
        ("natural/pruning", "depth"),
        ("natural/early_exit", "depth"),
        ("stress/mod", "depth"),  # the upper half: a band keeps its relative depth
        ("stress/moe", "depth"),  # every other block of the upper half only
    ],
)
def test_the_mapping_follows_the_jobs_placement(job: str, mapping: str) -> None:
    import yaml

    assert sim_scale.mapping_for(yaml.safe_load((ROOT / f"jobs/{job}.yaml").read_text())) == mapping


def test_mod_alternates_by_default() -> None:
    job = {"model": {"num_blocks": 8}, "schemes": {"mod": {"layers": None}}}
    assert sim_scale.mapping_for(job) == "periodic"
    job["schemes"] = {"moe": {"layers": None}}  # MoE's default: every block
    assert sim_scale.mapping_for(job) == "depth"


def test_the_table_shows_every_baseline_the_ceiling_and_the_limit() -> None:
    from dynmo_hpc.cli.simulate_scale import limits_json, result_json

    reports = scale_reports(_imbalanced_trajectory(8), _shapes(16), RATES, 8)
    setup = ReplaySetup(num_stages=4, num_microbatches=8, interval=5, num_steps=20, margin=0.0)
    result = simulate_stages(reports, setup, ["optimal", "diffusion"], steady_from_step=5)
    row = {**result_json(result), "limits": limits_json(result, 3.18)}
    rows = [{"scheme": "pruning", "jobs": "jobs/natural", "results": [row]}]
    paper = {"speedup_up_to": {"pruning": 3.18}}
    text = sim_scale.table(rows, paper)
    header, _, line = text.splitlines()
    for baseline in STATIC_BASELINES:  # a column over each registered static baseline
        assert f"over `{baseline}`" in header
    assert "what limits this row" in header and "the difference from the paper" in header
    names = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(names, [c.strip() for c in line.strip("|").split("|")], strict=True))
    lim = row["limits"]
    assert cells["best static"] == f"`{lim['best_static']}`"
    assert cells["capture"] == f"{lim['capture']:.2f}"
    assert cells["what limits this row"] == lim["what_limits"]
    assert cells["paper (up to)"] == "3.18"
    assert cells["the difference from the paper"].startswith("the trajectory:")
    summary = sim_scale.summary_row(rows, paper, [4])
    assert summary.startswith(sim_scale.SUMMARY_ROW) and "`jobs/natural`" in summary
    assert f"pruning {lim['achieved']:.2f}-{lim['achieved']:.2f}" in summary


def test_generated_sections_are_replaced_between_markers() -> None:
    text = f"a\n{sim_scale.BEGIN}\nold\n{sim_scale.END}\nb\n"
    assert (
        sim_scale.replace_between(text, "new") == f"a\n{sim_scale.BEGIN}\nnew\n{sim_scale.END}\nb\n"
    )
    with pytest.raises(ValueError, match="HINT: add the two markers"):
        sim_scale.replace_between("no markers", "new")
    row = f"{sim_scale.SUMMARY_ROW} old | x |"
    assert sim_scale.replace_row(f"h\n{row}\nt\n", "NEW") == "h\nNEW\nt\n"


def test_the_repository_has_the_markers_and_the_paper_file() -> None:
    import yaml

    assert sim_scale.BEGIN in sim_scale.TABLE_FILE.read_text()
    summary = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert sum(line.startswith(sim_scale.SUMMARY_ROW) for line in summary) == 1
    paper = yaml.safe_load(sim_scale.PAPER.read_text())
    assert "arXiv:2505.14864" in paper["citation"]
    assert set(paper["speedup_up_to"]) <= set(sim_scale.SCHEMES)
    for scheme in sim_scale.SCHEMES:
        assert (sim_scale.MODELS / f"{scheme}.yaml").is_file()
        for jobs in ("natural", "stress"):
            assert sim_scale.job_path(ROOT / "jobs" / jobs, scheme).is_file()
    with pytest.raises(ValueError, match="HINT: --jobs-dir takes a job set"):
        sim_scale.job_path(ROOT / "jobs", "no_such_scheme")
