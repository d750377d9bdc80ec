"""`dynmo-hpc report`: the PNGs exist, are real images, and plot exactly the numbers in the file."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import h5py
import matplotlib.image
import numpy as np
import pytest

from dynmo_hpc.cli import report as report_cli
from dynmo_hpc.runlog import RunLogWriter, load, report

NUM_LAYERS = 6


def _write_demo_run(path: Path) -> None:
    """60 steps: 3 unbalanced stages on 2 nodes, then a pack to 2 balanced stages on 1 node."""
    with RunLogWriter(path, config_yaml="job:\n  name: demo\n", meta={"launcher": "test"}) as w:
        for step in range(60):
            packed = step >= 30
            parts = [0, 3, 6] if packed else [0, 2, 4, 6]
            compute_s = [0.2, 0.2] if packed else [0.3, 0.1, 0.2]
            w.log_step(
                step=step,
                loss=4.0 - 0.05 * step,
                step_time_s=0.25 if packed else 0.35,
                tokens_per_s=1500.0 if packed else 1000.0,
                lr=1e-3,
                num_stages=len(parts) - 1,
                num_ranks=len(parts) - 1,
                num_nodes=1 if packed else 2,
            )
            w.log_stage_times(
                step=step, compute_s=compute_s, idle_s=[max(compute_s) - c for c in compute_s]
            )
            if step % 10 == 0:
                w.log_layer_report(
                    step=step,
                    forward_s=[0.01 * (i + 1) for i in range(NUM_LAYERS)],
                    backward_s=[0.02 * (i + 1) for i in range(NUM_LAYERS)],
                    num_params=[1000] * NUM_LAYERS,
                    param_bytes=[4000] * NUM_LAYERS,
                    grad_bytes=[4000] * NUM_LAYERS,
                    optim_bytes=[8000] * NUM_LAYERS,
                    parts=parts,
                )
                w.flush()
            if step == 29:
                w.log_event(step=step, kind="pack", detail={"old": [0, 2, 4, 6], "new": [0, 3, 6]})
            if step == 45:
                w.log_event(step=step, kind="checkpoint", detail={"path": "ckpt/45"})


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A demo run and its report, made once through the CLI entry points."""
    root = tmp_path_factory.mktemp("report")
    path = root / "demo" / "run.h5"
    _write_demo_run(path)
    parser = argparse.ArgumentParser(prog="dynmo-hpc")
    report_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(path.parent), "--out", str(root / "out")])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert args.func(args) == 0
    return path, root / "out", stdout.getvalue()


def _raw(path: Path, table: str) -> np.ndarray:
    """Read a table with h5py directly, so the check does not trust the loader."""
    with h5py.File(path, "r", swmr=True) as f:
        return f[table][()]


def _line(fig: object, label: str) -> np.ndarray:
    (ax,) = fig.axes  # type: ignore[attr-defined]
    (line,) = [ln for ln in ax.lines if ln.get_label() == label]
    xy = line.get_xydata()
    return xy[~np.isnan(xy[:, 1])]


def test_cli_prints_summary_and_paths(demo: tuple[Path, Path, str]) -> None:
    _, out, stdout = demo
    assert stdout.startswith("Run log ")
    for name in report.FIGURES:
        assert f"figure:  {out / (name + '.png')}" in stdout
    assert f"summary: {out / 'summary.txt'}" in stdout
    assert (out / "summary.txt").read_text() in stdout


@pytest.mark.parametrize("name", list(report.FIGURES))
def test_pngs_are_non_empty_images(demo: tuple[Path, Path, str], name: str) -> None:
    png = demo[1] / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


def test_time_series_plot_the_file_numbers(demo: tuple[Path, Path, str]) -> None:
    path = demo[0]
    run = load(path)
    steps = _raw(path, "steps")
    stage_times = _raw(path, "stage_times")

    tokens = _line(report.plot_tokens_per_s(run), "tokens/s")
    assert np.array_equal(tokens, np.column_stack([steps["step"], steps["tokens_per_s"]]))

    resources = report.plot_resources(run)
    for column, label in (("num_ranks", "ranks"), ("num_nodes", "nodes"), ("num_stages", "stages")):
        expected = np.column_stack([steps["step"], steps[column]])
        assert np.array_equal(_line(resources, label), expected)

    compute = report.plot_stage_compute(run)
    for stage in range(3):
        rows = stage_times[stage_times["stage"] == stage]
        expected = np.column_stack([rows["step"], rows["compute_s"]])
        assert np.array_equal(_line(compute, f"stage {stage}"), expected)

    imbalance = _line(report.plot_imbalance(run), "imbalance")
    expected = [
        [step, c.max() / c.mean()]
        for step in np.unique(stage_times["step"])
        for c in [stage_times["compute_s"][stage_times["step"] == step]]
    ]
    assert np.allclose(imbalance, expected)
    assert np.allclose(imbalance[:30, 1], 1.5) and np.allclose(imbalance[30:, 1], 1.0)

    (ax,) = compute.axes
    event_x = [ln.get_xdata()[0] for ln in ax.lines if ln.get_gid() == report.EVENT_GID]
    assert event_x == [29, 45]  # the end event is not drawn


def test_layer_stage_heatmap_is_the_file_partitions(demo: tuple[Path, Path, str]) -> None:
    path = demo[0]
    parts = _raw(path, "partitions")
    report_steps = np.unique(parts["step"])
    expected = np.full((NUM_LAYERS, len(report_steps)), -1)
    for row in parts:
        column = int(np.searchsorted(report_steps, row["step"]))
        expected[row["start_layer"] : row["end_layer"], column] = row["stage"]

    fig = report.plot_layer_stage_map(load(path))
    (mesh,) = fig.axes[0].collections
    drawn = np.asarray(mesh.get_array()).reshape(NUM_LAYERS, len(report_steps))
    assert np.array_equal(drawn, expected)
    assert expected[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert expected[:, -1].tolist() == [0, 0, 0, 1, 1, 1]


def test_summary_reports_throughput_imbalance_and_event_effects(
    demo: tuple[Path, Path, str],
) -> None:
    summary = (demo[1] / "summary.txt").read_text()
    assert "status: closed (ok) at step 59" in summary
    assert "Steps: 60 (0..59)" in summary
    assert "launcher: test" in summary
    assert (
        "step 29 pack: tokens/s 1000 -> 1500 (+50.0%); imbalance 1.500 -> 1.000; "
        "ranks 3 -> 2; nodes 2 -> 1" in summary
    )
    assert "step 45 checkpoint: tokens/s 1500 -> 1500 (+0.0%)" in summary
    assert '"path": "ckpt/45"' in summary
    assert "from step 0: parts [0, 2, 4, 6]" in summary
    assert "from step 30: parts [0, 3, 6]" in summary
    assert "median 1.250; first 1.500 (step 0); last 1.000 (step 59); worst 1.500" in summary


def test_empty_run_still_reports(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    RunLogWriter(path, config_yaml="", meta={}).close()
    run = load(path)
    text = report.summarize(run)
    assert "Steps: none logged" in text and "Load reports: none logged" in text
    for draw in report.FIGURES.values():
        assert draw(run).axes  # draws a "no data" panel instead of raising


def test_cli_reports_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(run_log=tmp_path / "nope.h5", out=None, window_steps=20)
    assert report_cli.run(args) == 2
    assert "no run log" in capsys.readouterr().err
