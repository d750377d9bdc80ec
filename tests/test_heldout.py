"""Held-out prediction (``dynmo_hpc.sim.heldout``, ``dynmo-hpc simulate --predict``) and the
machine calibration ``dynmo-hpc simulate`` uses by default."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import h5py
import pytest

from dynmo_hpc.balance.restart_overhead import estimated_restart_s
from dynmo_hpc.cli import main
from dynmo_hpc.runlog import load
from dynmo_hpc.sim.heldout import (
    HeldOutRow,
    after_pack_s,
    check_same_job,
    external_ratio,
    fit_machine,
    fit_oversubscribed,
    measured_step_s,
    median_row,
    predict,
    predict_pair,
    target_settings,
)
from dynmo_hpc.sim.machine import (
    MachineModel,
    Overheads,
    load_machine,
    machine_from_json,
    save_machine,
    shipped_machine_path,
)
from dynmo_hpc.sim.oversubscribed_cpu import fit_oversubscribed_cpu
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, replay, time_sliced
from dynmo_hpc.sim.runlog_traces import traces_from_runlog

SHIPPED = Path(__file__).resolve().parents[1] / "dynmo_hpc" / "sim" / "machines"


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(rc: int, out: str, err: str) -> str:
    assert rc != 0
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "HINT: " in lines[0] and "Traceback" not in err
    return lines[0]


# --- pure parts --------------------------------------------------------------------------------


def test_check_same_job_names_what_differs() -> None:
    a = {"model": {"d_model": 64}, "schemes": {}, "train": {"micro_batch_size": 2}}
    check_same_job(a, {**a, "pipeline": {"num_stages": 3}}, ("x", "y"))  # other stages: fine
    with pytest.raises(ValueError, match=r"y is not the same job as x .* in model\); HINT"):
        check_same_job(a, {**a, "model": {"d_model": 128}}, ("x", "y"))
    with pytest.raises(ValueError, match=r"train\.micro_batch_size"):
        check_same_job(a, {**a, "train": {"micro_batch_size": 4}}, ("x", "y"))


def test_target_settings_maps_static_to_uniform_and_refuses_a_baseline() -> None:
    config = {
        "pipeline": {"num_stages": 3, "schedule": "1f1b"},
        "train": {"num_microbatches": 6, "steps": 20},
        "balance": {"algorithm": "static", "interval": 5, "margin": 0.1, "smoothing": 0.5},
    }
    settings = target_settings(config)
    assert (settings.num_stages, settings.num_microbatches, settings.algorithm) == (3, 6, "uniform")
    assert settings.num_steps == 20 and settings.interval == 5
    config["balance"]["algorithm"] = "parameters"
    with pytest.raises(ValueError, match="no replayed equivalent; HINT"):
        target_settings(config, "y")


def test_an_elastic_target_is_replayed_as_packing_with_its_own_elastic_settings() -> None:
    config = {
        "pipeline": {"num_stages": 4, "schedule": "1f1b"},
        "train": {"num_microbatches": 8, "steps": 40},
        "balance": {"algorithm": "optimal", "interval": 5, "margin": 0.1, "smoothing": 0.5},
        "elastic": {"enabled": True, "interval": 1, "min_stages": 2, "max_slowdown": 0.05},
    }
    settings = target_settings(config)
    assert settings.algorithm == "packing"
    assert (settings.packing.interval, settings.packing.min_stages) == (1, 2)
    config["elastic"]["enabled"] = False
    assert target_settings(config).algorithm == "optimal"


def _packed_log(resize_step: int | None) -> object:
    """The two tables :func:`after_pack_s` reads: 10 steps of 2 s, then 1 s after step 4."""
    import pandas as pd

    steps = pd.DataFrame({"step": range(10), "step_time_s": [2.0] * 5 + [1.0] * 5})
    kinds = [] if resize_step is None else [("resize", resize_step)]
    events = pd.DataFrame({"kind": [k for k, _ in kinds], "step": [s for _, s in kinds]})
    return SimpleNamespace(steps=steps, events=events, path=Path("run.h5"))


def test_after_pack_is_the_median_after_the_first_resize() -> None:
    assert after_pack_s(_packed_log(4)) == (4, 1.0)  # type: ignore[arg-type]
    assert after_pack_s(_packed_log(None)) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packed at its last step; HINT"):
        after_pack_s(_packed_log(9))  # type: ignore[arg-type]


def test_machine_file_external_load_round_trips_and_unknown_keys() -> None:
    model = machine_from_json({"external_wall_s_per_cpu_s": 1.25, "cores": 2})
    assert model.external_wall_s_per_cpu_s == 1.25
    assert machine_from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="must be > 0"):
        machine_from_json({"external_wall_s_per_cpu_s": 0})
    # A key another calibration added is ignored; one that looks like a typo is refused.
    assert machine_from_json({"layer_fit_notes_v2": 3}) == MachineModel()
    with pytest.raises(ValueError, match="did you mean 'external_wall_s_per_cpu_s'"):
        machine_from_json({"external_wall_s_per_cpu": 1.0})


def test_fit_oversubscribed_solves_for_a_median_step_ratio_of_one() -> None:
    # Three runs whose predicted steps grow in proportion to the factor: the median ratio.
    measured, base = [1.2, 2.1, 0.55], [1.0, 2.0, 0.5]
    fitted = fit_oversubscribed(measured, lambda f: [f * p for p in base])
    assert fitted == pytest.approx(1.1, abs=1e-3)
    # Half of a run's step time-sliced: the factor makes up the whole step's gap on that half.
    fitted = fit_oversubscribed([1.2], lambda f: [0.5 + 0.5 * f])
    assert fitted == pytest.approx(1.4, abs=1e-3)
    assert fit_oversubscribed([0.9], lambda f: [f]) == 1.0  # faster than simulated: noise
    assert fit_oversubscribed([9.0], lambda f: [f]) == 3.0  # capped
    assert fit_oversubscribed([], lambda f: []) is None  # no such run: the file has no factor
    with pytest.raises(ValueError, match="2 measured steps but 1 predicted"):
        fit_oversubscribed([1.0, 1.0], lambda f: [1.0])


def _oversubscribed_step_s(
    num_stages: int, factor: float, *, external: bool = True, cores: float = 2.0, heavy: float = 1.0
) -> float:
    """Median replayed step of 6 layers (the last ``heavy`` times the others) on ``num_stages``
    stages sharing ``cores`` cores. Distinct stage loads: equal ones would leave the home-core
    placement to float rounding."""
    forward_s = [0.010, 0.013, 0.016, 0.019, 0.022, heavy * 0.025]
    report = CostReport(
        forward_s=forward_s,
        backward_s=[2 * x for x in forward_s],
        num_params=[10] * 6,
        layer_bytes=[100] * 6,
    )
    setup = ReplaySetup(
        num_stages=num_stages,
        num_microbatches=4,
        interval=2,
        cores=cores,
        ratios_are_external=external,
        oversubscribed_wall_s_per_cpu_s=factor,
    )
    return replay([report], setup, "uniform").median_step_time_s


def test_the_oversubscription_factor_stretches_only_stages_that_time_slice() -> None:
    step = _oversubscribed_step_s
    # Pooled cores (fractional): every stage time-slices; no link, no wake-up, so every second
    # of the step is CPU work and the whole step scales by the factor.
    assert step(3, 1.25, cores=1.5) == pytest.approx(1.25 * step(3, 1.0, cores=1.5))
    # 3 stages on 2 cores, the last stage far the heaviest: it keeps a core to itself, sets the
    # step, and does not pay the factor; the two light stages that share the other core do.
    assert time_sliced([0.01, 0.02, 0.2], [0.02, 0.04, 0.4], 4, 2.0) == [True, True, False]
    assert step(3, 1.0, heavy=8.0) < step(3, 1.25, heavy=8.0) < 1.05 * step(3, 1.0, heavy=8.0)
    # 2 stages on 2 cores: a core each, no time-slicing, no factor.
    assert step(2, 1.25) == step(2, 1.0)
    # A run's own measured ratios already contain it: not applied again.
    assert step(3, 1.25, external=False) == step(3, 1.0, external=False)
    with pytest.raises(ValueError, match=r"oversubscribed_wall_s_per_cpu_s=0\.0 must be"):
        step(3, 0.0)


def test_machine_file_oversubscription_round_trips() -> None:
    model = machine_from_json({"oversubscribed_wall_s_per_cpu_s": 1.08, "cores": 2})
    assert model.oversubscribed_wall_s_per_cpu_s == 1.08
    assert machine_from_json(model.to_json()) == model
    assert machine_from_json({}).oversubscribed_wall_s_per_cpu_s is None
    with pytest.raises(ValueError, match="must be > 0"):
        machine_from_json({"oversubscribed_wall_s_per_cpu_s": 0})
    with pytest.raises(ValueError, match="did you mean 'oversubscribed_wall_s_per_cpu_s'"):
        machine_from_json({"oversubscribed_wall_s_per_cpu": 1.0})


def test_the_shipped_calibration_loads_and_was_fitted_held_out() -> None:
    path = shipped_machine_path(2)
    assert path == SHIPPED / "cpu_2core.json"
    machine = load_machine(path)
    assert machine.cores == 2 and machine.external_wall_s_per_cpu_s is not None
    assert machine.wall_s_per_cpu_s is None  # no run's own ratio in a machine calibration
    assert machine.notes is not None and machine.notes["fitted_on"]
    assert shipped_machine_path(3) is None


# --- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real tiny runs (about 10 s each): a 2-stage source, a 3-stage target of the same
    job, and a 2-stage run of another job (a wider feed-forward)."""
    from dynmo_hpc.launch.local import run_local
    from tests.helpers.jobs import tiny_config

    root = tmp_path_factory.mktemp("heldout")
    out = {}
    for name, extra in (
        ("src", ["pipeline.num_stages=2"]),
        ("p3", ["pipeline.num_stages=3"]),
        ("other", ["pipeline.num_stages=2", "model.d_ff=128"]),
    ):
        cfg = tiny_config(root, f"job.name={name}", "train.steps=6", *extra)
        assert run_local(cfg, timeout_s=180).exit_code == 0
        out[name] = cfg.run_dir / "run.h5"
    return out


def _corrupt_wall_times(path: Path, dest: Path, factor: float) -> Path:
    """A copy of ``path`` whose every wall time (steps and stage times) is ``factor`` times
    the measured one; its layer costs (CPU) and config untouched."""
    shutil.copy(path, dest)
    with h5py.File(dest, "r+") as f:
        steps = f["steps"][...]
        steps["step_time_s"] *= factor
        steps["wall_s_per_cpu_s"] *= factor
        f["steps"][...] = steps
        times = f["stage_times"][...]
        times["compute_s"] *= factor
        times["idle_s"] *= factor
        f["stage_times"][...] = times
    return dest


@pytest.mark.slow
def test_prediction_never_reads_the_targets_wall_times(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The target's wall times move the measured column and nothing else."""
    machine = MachineModel(overheads=Overheads(step_s=0.004), cores=2.0)
    machine = machine_from_json(
        {
            **machine.to_json(),
            "external_wall_s_per_cpu_s": 1.1,
            "oversubscribed_wall_s_per_cpu_s": 1.2,
        }
    )
    source, target = load(runs["src"]), load(runs["p3"])
    bad = load(_corrupt_wall_times(runs["p3"], tmp_path / "bad.h5", 7.0))
    assert measured_step_s(bad) == pytest.approx(7.0 * measured_step_s(target))
    row = predict_pair(source, target, machine, ("src", "p3"))
    row_bad = predict_pair(source, bad, machine, ("src", "p3"))
    assert row_bad.predicted_target_s == row.predicted_target_s
    assert row_bad.predicted_source_s == row.predicted_source_s
    assert row_bad.measured_target_s == pytest.approx(7.0 * row.measured_target_s)
    # The prediction is the replay of the source's CPU costs on the target's 3 stages.
    expected = predict(traces_from_runlog(source), target_settings(target.config), machine)
    assert row.predicted_target_s == expected.median_step_time_s
    assert expected.final_parts[-1] == len(traces_from_runlog(source).reports[0].forward_s)
    assert len(expected.final_parts) == 4


@pytest.mark.slow
def test_a_trace_replaces_both_runs_own_costs(runs: dict[str, Path]) -> None:
    """With a trace, source and target are both predicted from the trace's load reports: the
    same numbers as replaying the trace under each run's settings; a trace of another job is
    refused."""
    machine = MachineModel(overheads=Overheads(step_s=0.004), cores=2.0)
    source, target, trace = load(runs["src"]), load(runs["p3"]), load(runs["p3"])
    row = predict_pair(source, target, machine, ("src", "p3"), trace=("t", trace))
    traces = traces_from_runlog(trace)
    for settings_of, predicted in (
        (source, row.predicted_source_s),
        (target, row.predicted_target_s),
    ):
        expected = predict(traces, target_settings(settings_of.config), machine)
        assert predicted == expected.median_step_time_s
    assert row.trace == "t" and row.measured_source_s == measured_step_s(source)
    own = predict_pair(source, target, machine, ("src", "p3"))
    assert own.trace == "" and own.predicted_source_s != row.predicted_source_s
    with pytest.raises(ValueError, match="not the same job"):
        predict_pair(source, target, machine, ("src", "p3"), trace=("o", load(runs["other"])))


@pytest.mark.slow
def test_fit_machine_uses_only_the_calibration_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    """Corrupting a run that is not in the calibration set changes nothing in the fit; the
    calibration runs' own wall times do move it (so the fit reads what it should)."""
    base = MachineModel(overheads=Overheads(optimizer_s_per_param=4e-9), cores=2.0)
    cal = [("src", load(runs["src"])), ("other", load(runs["other"]))]
    fitted = fit_machine(cal, base)
    assert fitted.notes == {"fitted_on": ["src", "other"]}
    assert fitted.external_wall_s_per_cpu_s is not None
    assert fitted.external_wall_s_per_cpu_s >= 1.0
    assert fitted.overheads.optimizer_s_per_param == 4e-9
    slow = load(_corrupt_wall_times(runs["src"], tmp_path / "slow.h5", 5.0))
    refit = fit_machine([("src", slow), cal[1]], base)
    assert refit.external_wall_s_per_cpu_s != fitted.external_wall_s_per_cpu_s
    # 5x the wall time: at least 3x the load (each step's ratio is floored at 1 before the
    # median, so a quiet run's median may have been lifted to 1).
    assert external_ratio(slow, base) > 3.0 * external_ratio(cal[0][1], base)
    # Only 2-stage runs on 2 cores: no oversubscription factor to fit.
    assert fitted.oversubscribed_wall_s_per_cpu_s is None


@pytest.mark.slow
def test_fit_machine_fits_the_oversubscription_factor_on_its_own_runs_only(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The 3-stage run on 2 cores gives the factor; its wall times move it, the runs outside
    the calibration set (the 2-stage source) cannot."""
    base = MachineModel(overheads=Overheads(optimizer_s_per_param=4e-9), cores=2.0)
    src, p3, other = (load(runs[name]) for name in ("src", "p3", "other"))
    fitted = fit_machine([("p3", p3), ("other", other)], base)
    assert fitted.oversubscribed_wall_s_per_cpu_s is not None
    # No job ran at both 2 and 3 stages here: no CPU factor. With src and p3 (one job), one.
    assert fitted.oversubscribed_cpu_s_per_cpu_s is None
    both = fit_machine([("src", src), ("p3", p3)], base)
    expected = fit_oversubscribed_cpu(
        [(traces_from_runlog(src), "job"), (traces_from_runlog(p3), "job")], 2.0
    )
    assert expected is not None and both.oversubscribed_cpu_s_per_cpu_s == expected
    assert machine_from_json(both.to_json()) == both
    # A run that never resized: the trainer's estimate from its logged start-up and state.
    traces = traces_from_runlog(src)
    launches = src.events[src.events["kind"] == "launch"]["detail"].tolist()
    assert launches, "the run logged no start-up"
    state_bytes = float(sum(traces.reports[0].layer_bytes))
    assert traces.measured_restart_s == pytest.approx(
        estimated_restart_s(float(launches[0]["startup_s"]), None, state_bytes)
    )
    assert fitted.oversubscribed_wall_s_per_cpu_s >= 1.0
    # The fit is the definition: p3 replayed from its own costs with the factor meets its
    # measured step (or the factor is 1: predicted at or above it already).
    own = predict(traces_from_runlog(p3), target_settings(p3.config), fitted)
    if fitted.oversubscribed_wall_s_per_cpu_s > 1.0:
        assert own.median_step_time_s == pytest.approx(measured_step_s(p3), rel=1e-3)
    slow = load(_corrupt_wall_times(runs["p3"], tmp_path / "slow_p3.h5", 3.0))
    refit = fit_machine([("p3", slow), ("other", other)], base)
    assert refit.oversubscribed_wall_s_per_cpu_s is not None
    assert refit.oversubscribed_wall_s_per_cpu_s > 1.2 * fitted.oversubscribed_wall_s_per_cpu_s
    # Predicting p3 from src: the factor slows the 3-stage prediction, by at most itself, and
    # leaves the 2-stage source's own replay alone.
    with_factor = predict_pair(src, p3, refit, ("src", "p3"))
    without = predict_pair(src, p3, replace(refit, oversubscribed_wall_s_per_cpu_s=None), ("", ""))
    assert without.predicted_target_s < with_factor.predicted_target_s
    assert with_factor.predicted_target_s <= 1.001 * (
        refit.oversubscribed_wall_s_per_cpu_s * without.predicted_target_s
    )
    assert with_factor.predicted_source_s == without.predicted_source_s


@pytest.mark.slow
def test_cli_predict_prints_the_table_and_writes_json(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    machine = SHIPPED / "cpu_2core.json"
    argv = ["--from", str(runs["src"]), "--predict", str(runs["p3"].parent), "--machine"]
    rc, out, err = _cli([*argv, str(machine), "--json-out", str(tmp_path / "t.json")], capsys)
    assert rc == 0, err
    assert out.startswith(f"calibration: {machine} (--machine)")
    header, row = out.splitlines()[1:3]
    assert header.split()[:4] == ["target", "P", "M", "algorithm"]
    assert row.split()[:4] == ["p3", "3", "4", "uniform"]
    table = json.loads((tmp_path / "t.json").read_text())
    (entry,) = table["rows"]
    expected = predict_pair(load(runs["src"]), load(runs["p3"]), load_machine(machine), ("", ""))
    assert entry["predicted_target_s"] == pytest.approx(expected.predicted_target_s)
    assert entry["measured_target_s"] == pytest.approx(expected.measured_target_s)
    assert entry["speedup_error"] == pytest.approx(expected.speedup_error)
    # --json prints the same object.
    rc, out, err = _cli([*argv, str(machine), "--json"], capsys)
    assert rc == 0 and json.loads(out)["rows"] == table["rows"]


@pytest.mark.slow
def test_cli_defaults_to_the_shipped_calibration_and_says_so(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    rc, out, err = _cli(["--from", str(runs["src"]), "--algorithms", "uniform"], capsys)
    assert rc == 0, err
    shipped = f"; calibration: {SHIPPED / 'cpu_2core.json'} (shipped for this machine)"
    assert out.splitlines()[0].endswith(shipped)
    default = float(out.splitlines()[-1].split()[1])
    rc, out, _ = _cli(
        [
            "--from",
            str(runs["src"]),
            "--algorithms",
            "uniform",
            "--machine",
            str(SHIPPED / "cpu_2core.json"),
        ],
        capsys,
    )
    assert float(out.splitlines()[-1].split()[1]) == default
    rc, out, _ = _cli(
        ["--from", str(runs["src"]), "--algorithms", "uniform", "--machine", "none"], capsys
    )
    assert out.splitlines()[0].endswith("; calibration: none (compute-only model)")
    assert float(out.splitlines()[-1].split()[1]) < default  # no overheads, no sharing
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(7)))
    rc, out, _ = _cli(["--from", str(runs["src"]), "--algorithms", "uniform"], capsys)
    assert "no calibration is shipped for this machine" in out.splitlines()[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--predict", "/nonexistent/run.h5"], "no run log"),
        (["--predict", "OTHER"], "is not the same job as"),
        (["--predict", "P3", "--wall-per-cpu", "run"], "cannot be given with it"),
        (["--predict", "P3", "--stages", "4"], "--stages cannot be given"),
    ],
)
def test_cli_predict_bad_input_is_one_error_line(
    runs: dict[str, Path], extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"OTHER": str(runs["other"]), "P3": str(runs["p3"])}
    argv = ["--from", str(runs["src"]), *(names.get(a, a) for a in extra)]
    assert match in _one_error_line(*_cli(argv, capsys))


def test_cli_predict_needs_from(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--costs", "1,1", "--stages", "2", "--microbatches", "2", "--predict", "x.h5"]
    assert "--predict needs --from" in _one_error_line(*_cli(argv, capsys))


def _heldout_script() -> object:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "heldout_sim.py"
    spec = importlib.util.spec_from_file_location("heldout_sim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("heldout_sim", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_heldout_script_keeps_calibration_and_held_out_apart(tmp_path: Path) -> None:
    """The benchmark's design: at least 8 pairs, every pair's runs held out and of one job, no
    calibration run among them, and the hidden case is the issue's (imbalanced, 3 stages, 6
    microbatches, static)."""
    script: object = _heldout_script()
    held_out = {r.name: r for r in script.HELD_OUT}  # type: ignore[attr-defined]
    calibration = {r.name for r in script.CALIBRATION}  # type: ignore[attr-defined]
    pairs = script.PAIRS  # type: ignore[attr-defined]
    assert len(pairs) >= 8 and len(set(pairs)) == len(pairs)
    assert not calibration & set(held_out)
    no_packing = set(script.NO_PACKING)  # type: ignore[attr-defined]
    packing = []
    for x, y in pairs:
        assert x in held_out and y in held_out and x != y
        assert held_out[x].job == held_out[y].job
        assert set(held_out[x].extra) - no_packing == set(held_out[y].extra) - no_packing
        source, target = (script.run_config(held_out[r], tmp_path) for r in (x, y))  # type: ignore[attr-defined]
        assert not source.elastic.enabled  # a source never packs: its costs are its stages'
        if target.elastic.enabled:
            packing.append(y)
    assert packing, "a pair predicts a packing run"
    assert {held_out[y].num_stages for _, y in pairs} >= {2, 3}
    assert {held_out[y].algorithm for _, y in pairs} >= {"static", "optimal", "diffusion"}
    hidden = script.run_config(held_out[script.HIDDEN], tmp_path)  # type: ignore[attr-defined]
    # The scheme pairs: X and Y predicted from a third run T of the same natural job.
    scheme_runs = {r.name: r for r in script.SCHEME_RUNS}  # type: ignore[attr-defined]
    assert not set(scheme_runs) & (calibration | set(held_out))
    jobs = set()
    for t, x, y in script.SCHEME_PAIRS:  # type: ignore[attr-defined]
        assert len({t, x, y}) == 3
        cfgs = [script.run_config(scheme_runs[r], tmp_path) for r in (t, x, y)]  # type: ignore[attr-defined]
        assert cfgs[0].job.seed != cfgs[1].job.seed == cfgs[2].job.seed  # T trained on its own
        assert [c.balance.algorithm for c in cfgs] == ["static", "static", "optimal"]
        assert len({scheme_runs[r].job for r in (t, x, y)}) == 1
        jobs.add(scheme_runs[x].job)
    assert jobs == {"natural/pruning", "natural/freezing", "natural/early_exit"}
    assert hidden.model.layer_d_ff is not None  # jobs/imbalanced.yaml
    assert (hidden.pipeline.num_stages, hidden.train.num_microbatches) == (3, 6)
    assert hidden.balance.algorithm == "static"


def test_heldout_script_keeps_the_layer_rates_of_the_file_it_rewrites(tmp_path: Path) -> None:
    """The shipped calibration is one file two scripts write: heldout_sim's calibration (whose
    base machine has no layer rates) must keep the per-layer rates fit_cost_model.py put there,
    and their notes; a file without rates stays without."""
    script: object = _heldout_script()
    keep = script.keep_layer_rates  # type: ignore[attr-defined]
    shipped = load_machine(SHIPPED / "cpu_2core.json")
    assert shipped.layer_rates is not None and shipped.notes is not None
    target = tmp_path / "cpu.json"
    save_machine(shipped, target)
    fitted = MachineModel(cores=2.0, notes={"how": "benchmarks/heldout_sim.py"})
    kept = keep(fitted, target)
    assert kept.layer_rates == shipped.layer_rates
    assert kept.notes["layer_rates"] == shipped.notes["layer_rates"]
    assert kept.notes["how"] == "benchmarks/heldout_sim.py" and kept.cores == 2.0
    save_machine(fitted, target)
    assert keep(fitted, target).layer_rates is None
    assert keep(fitted, tmp_path / "missing.json") == fitted


def test_median_row_takes_each_figure_over_the_repeats() -> None:
    """Three repeats of one pair: every measured and predicted step is its median; the speedups
    and errors follow from those medians; rows of another pair are refused."""
    settings = target_settings(
        {
            "pipeline": {"num_stages": 2, "schedule": "1f1b"},
            "train": {"num_microbatches": 4, "steps": 20},
            "balance": {"algorithm": "optimal", "interval": 5, "margin": 0.1, "smoothing": 0.5},
        }
    )
    figures = [(1.0, 0.5, 0.9, 0.6), (3.0, 0.7, 1.1, 0.4), (2.0, 0.6, 1.0, 0.5)]
    rows = [
        HeldOutRow(
            source="x",
            target="y",
            target_settings=settings,
            measured_source_s=a,
            measured_target_s=b,
            predicted_source_s=c,
            predicted_target_s=d,
        )
        for a, b, c, d in figures
    ]
    row = median_row(rows)
    assert (row.measured_source_s, row.measured_target_s) == (2.0, 0.6)
    assert (row.predicted_source_s, row.predicted_target_s) == (1.0, 0.5)
    assert row.measured_speedup == pytest.approx(2.0 / 0.6)
    assert row.step_error == pytest.approx(0.5 / 0.6 - 1)
    with pytest.raises(ValueError, match="one pair"):
        median_row([rows[0], replace(rows[1], target="z")])
    with pytest.raises(ValueError, match="at least one"):
        median_row([])


def test_a_repeat_predicting_another_packing_decision_is_a_miss_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """heldout_sim's pair row over 3 repeats where one repeat's replay packs differently from
    its target: the row is the median of the other two, says how many were left out, and is
    not within tolerance however close its medians; if every repeat's does, the row has
    its measured steps only."""
    from dynmo_hpc.sim.heldout import PackingMismatch

    script: object = _heldout_script()
    settings = target_settings(
        {
            "pipeline": {"num_stages": 2, "schedule": "1f1b"},
            "train": {"num_microbatches": 4, "steps": 20},
            "balance": {"algorithm": "optimal", "interval": 5, "margin": 0.1, "smoothing": 0.5},
        }
    )

    def fake_predict(source: str, target: str, _machine: object, names: tuple[str, str]):
        if target.endswith("_r1"):
            raise PackingMismatch(f"{target} packed to 2 stages, the prediction to 4")
        return HeldOutRow(
            source=names[0],
            target=names[1],
            target_settings=settings,
            measured_source_s=1.0,
            measured_target_s=0.5,
            predicted_source_s=1.0,
            predicted_target_s=0.5,
        )

    monkeypatch.setattr(script, "predict_pair", fake_predict)
    logs = {n: n for n in ("x", "x_r1", "x_r2", "y", "y_r1", "y_r2")}
    row = script.pair_row(logs, None, "x", "y", 3)  # type: ignore[attr-defined]
    assert (row.source, row.target, row.mispredicted_repeats) == ("x", "y", 1)
    assert row.step_error == 0.0 and row.speedup_error == 0.0
    assert not row.within(0.10) and replace(row, mispredicted_repeats=0).within(0.10)
    assert not replace(row, predicted_target_s=0.6).within(0.10)  # +20 % on the step
    monkeypatch.setattr(
        script, "predict_pair", lambda *a: (_ for _ in ()).throw(PackingMismatch("never packed"))
    )
    monkeypatch.setattr(script, "_unpredicted_row", lambda *a: ("measured only", *a[1:]))
    assert script.pair_row(logs, None, "x", "y", 3) == ("measured only", "x", "y", 3)  # type: ignore[attr-defined]


def test_a_scheme_pair_predicts_both_runs_from_its_trace_repeat_by_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """heldout_sim's scheme pair: repeat r of X and Y predicted from repeat r of the trace T;
    the row names T; a classic pair passes no trace (its source's own costs)."""
    script: object = _heldout_script()
    settings = target_settings(
        {
            "pipeline": {"num_stages": 2, "schedule": "1f1b"},
            "train": {"num_microbatches": 8, "steps": 50},
            "balance": {"algorithm": "optimal", "interval": 5, "margin": 0.1, "smoothing": 0.5},
        }
    )
    calls: list[tuple[str, str, str | None]] = []

    def fake_predict(
        source: str,
        target: str,
        _machine: object,
        names: tuple[str, str],
        trace: tuple[str, str] | None = None,
    ) -> HeldOutRow:
        calls.append((source, target, None if trace is None else trace[0]))
        assert trace is None or trace[1] == trace[0]  # the trace's own log
        return HeldOutRow(
            source=names[0],
            target=names[1],
            target_settings=settings,
            measured_source_s=1.2,
            measured_target_s=1.0,
            predicted_source_s=1.1,
            predicted_target_s=1.0,
            trace="" if trace is None else trace[0],
        )

    monkeypatch.setattr(script, "predict_pair", fake_predict)
    logs = {n: n for n in ("t", "t_r1", "x", "x_r1", "y", "y_r1")}
    row = script.pair_row(logs, None, "x", "y", 2, "t")  # type: ignore[attr-defined]
    assert calls == [("x", "y", "t"), ("x_r1", "y_r1", "t_r1")]
    assert (row.source, row.target, row.trace) == ("x", "y", "t")
    assert row.to_json()["trace"] == "t"
    assert row.measured_speedup == pytest.approx(1.2) and row.predicted_speedup == pytest.approx(
        1.1
    )
    calls.clear()
    classic = script.pair_row(logs, None, "x", "y", 1)  # type: ignore[attr-defined]
    assert calls == [("x", "y", None)] and classic.trace == ""
    assert classic.to_json()["trace"] == "x"


def test_heldout_script_makes_its_repeats_in_rounds() -> None:
    """Repeat 0 of every run, then repeat 1 of every run: a pair's source and target of one
    repeat run close together, and a slow spell of the machine falls on one repeat."""
    script: object = _heldout_script()
    runs = script.HELD_OUT[:3]  # type: ignore[attr-defined]
    order = [r.name for r in script.repeated(runs, 2)]  # type: ignore[attr-defined]
    assert order == [*(r.name for r in runs), *(f"{r.name}_r1" for r in runs)]
    assert [r.name for r in script.repeated(runs, 1)] == [r.name for r in runs]  # type: ignore[attr-defined]
