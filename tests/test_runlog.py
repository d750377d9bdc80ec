"""The run log writer and loader in one process: round trip, validation, flushing, resume, docs."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from dynmo_hpc.runlog import SCHEMA_VERSION, RunLogWriter, load, schema

CONFIG_YAML = "job:\n  name: unit\ntrain:\n  steps: 4\n"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "runlog.md"


def _step(w: RunLogWriter, step: int, num_stages: int = 2) -> None:
    w.log_step(
        step=step,
        loss=5.0 - step,
        step_time_s=0.5 + step,
        tokens_per_s=1000.0 * (step + 1),
        lr=1e-3 / (step + 1),
        num_stages=num_stages,
        num_ranks=num_stages,
        num_nodes=1,
    )


def _layer_report(w: RunLogWriter, step: int, parts: list[int], **kw: object) -> None:
    n = parts[-1]
    w.log_layer_report(
        step=step,
        forward_s=[0.1 * (i + 1) for i in range(n)],
        backward_s=[0.2 * (i + 1) for i in range(n)],
        num_params=[100 + i for i in range(n)],
        param_bytes=[400 + i for i in range(n)],
        grad_bytes=[400 + i for i in range(n)],
        optim_bytes=[800 + i for i in range(n)],
        parts=parts,
        **kw,  # type: ignore[arg-type]
    )


def test_round_trip_with_changing_stage_count(tmp_path: Path) -> None:
    path = tmp_path / "job" / "run.h5"
    with RunLogWriter(path, config_yaml=CONFIG_YAML, meta={"launcher": "mpiexec", "ranks": 3}) as w:
        for step in range(3):
            _step(w, step, num_stages=3)
            w.log_stage_times(step=step, compute_s=[1.0, 2.0, 3.0], idle_s=[2.0, 1.0, 0.0])
        _layer_report(w, 2, [0, 1, 3, 4], peak_mem_bytes=[10, 20, 30])
        w.log_event(step=2, kind="pack", detail={"old_parts": [0, 1, 3, 4], "new_parts": [0, 2, 4]})
        w.flush()
        _step(w, 3, num_stages=2)
        w.log_stage_times(step=3, compute_s=[2.5, 2.5], idle_s=[0.0, 0.0])
        _layer_report(w, 3, [0, 2, 4])

    run = load(path)
    assert run.config == {"job": {"name": "unit"}, "train": {"steps": 4}}
    assert run.attrs["schema_version"] == SCHEMA_VERSION
    assert run.attrs["config_yaml"] == CONFIG_YAML
    assert run.attrs["launcher"] == "mpiexec" and run.attrs["ranks"] == 3
    assert {"package_version", "start_time_utc", "hostname", "pid"} <= set(run.attrs)

    assert run.steps["step"].tolist() == [0, 1, 2, 3]
    assert run.steps["loss"].tolist() == [5.0, 4.0, 3.0, 2.0]
    assert run.steps["tokens_per_s"].tolist() == [1000.0, 2000.0, 3000.0, 4000.0]
    assert run.steps["num_stages"].tolist() == [3, 3, 3, 2]
    assert (run.steps["wall_s"].diff().dropna() >= 0).all()

    st = run.stage_times
    assert len(st) == 3 * 3 + 2
    assert st[st["step"] == 3]["compute_s"].tolist() == [2.5, 2.5]
    assert st[st["step"] == 0]["idle_s"].tolist() == [2.0, 1.0, 0.0]

    lc = run.layer_costs
    assert lc[lc["step"] == 2]["layer"].tolist() == [0, 1, 2, 3]
    assert lc[lc["step"] == 3]["optim_bytes"].tolist() == [800, 801, 802, 803]
    assert np.allclose(lc[lc["step"] == 2]["backward_s"], [0.2, 0.4, 0.6, 0.8])

    assert run.report_steps() == [2, 3]
    assert run.parts_at(2) == [0, 1, 3, 4]
    assert run.parts_at(3) == [0, 2, 4]
    parts = run.partitions
    assert parts[parts["step"] == 2]["peak_mem_bytes"].tolist() == [10, 20, 30]
    assert parts[parts["step"] == 3]["peak_mem_bytes"].tolist() == [schema.UNKNOWN_INT] * 2

    assert run.events["kind"].tolist() == ["pack", "end"]
    assert run.events["detail"].iloc[0] == {"old_parts": [0, 1, 3, 4], "new_parts": [0, 2, 4]}
    assert run.end_status == "ok"


def test_file_appears_complete_and_in_swmr_mode(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    w = RunLogWriter(path, config_yaml=CONFIG_YAML, meta={})
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]  # no temp file left
        with h5py.File(path, "r", swmr=True) as f:
            assert f.swmr_mode
            names = {spec.name for spec in schema.TABLES} | {schema.EVENT_DETAIL}
            assert set(f) == names
            for spec in schema.TABLES:
                assert f[spec.name].dtype == spec.dtype
                assert f[spec.name].maxshape == (None,)
                assert f[spec.name].chunks == (spec.chunk_rows,)
            assert set(schema.ROOT_ATTRS) <= set(f.attrs)
    finally:
        w.close()


def test_rows_reach_the_file_only_on_flush_or_thresholds(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    w = RunLogWriter(path, config_yaml="", meta={}, flush_every_rows=5, flush_every_s=1e9)
    for step in range(4):
        _step(w, step)
    assert len(load(path).steps) == 0  # buffered
    _step(w, 4)  # the 5th buffered row triggers a flush
    assert len(load(path).steps) == 5
    _step(w, 5)
    w.flush()
    assert len(load(path).steps) == 6
    w.flush_every_s = 0.0  # every row is now past the time threshold
    _step(w, 6)
    assert len(load(path).steps) == 7
    w.close()
    assert load(path).steps["step"].tolist() == list(range(7))


def test_event_details_survive_any_json_and_size(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    big = "x" * (3 * schema.EVENT_DETAIL_CHUNK_BYTES)  # spans several chunks
    details = [
        {"note": "Größe ✓", "nested": {"a": [1, 2.5, None, True]}},
        {"costs": np.array([0.5, 1.5]), "layer": np.int64(7), "path": Path("/x/y")},
        {"big": big},
        {},
    ]
    with RunLogWriter(path, config_yaml="", meta={}) as w:
        for i, detail in enumerate(details):
            w.log_event(step=i, kind=f"kind_{i}", detail=detail)
            if i == 1:
                w.flush()
    events = load(path).events
    assert events["kind"].tolist() == ["kind_0", "kind_1", "kind_2", "kind_3", "end"]
    assert events["detail"].iloc[0] == details[0]
    assert events["detail"].iloc[1] == {"costs": [0.5, 1.5], "layer": 7, "path": "/x/y"}
    assert events["detail"].iloc[2]["big"] == big
    assert events["detail"].iloc[3] == {}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w: w.log_stage_times(step=0, compute_s=[1.0, 2.0], idle_s=[1.0]), "lengths"),
        (lambda w: _layer_report(w, 0, [0, 3, 2, 4]), "not a partition"),
        (lambda w: _layer_report(w, 0, [1, 4]), "parts\\[0\\]=0"),
        (lambda w: _layer_report(w, 0, [0, 2, 4], peak_mem_bytes=[1]), "one per stage"),
        (lambda w: w.log_event(step=0, kind="k" * 33, detail={}), "1..32"),
        (lambda w: w.log_event(step=0, kind="", detail={}), "1..32"),
    ],
)
def test_bad_input_is_rejected_with_the_expectation(
    tmp_path: Path, call: object, message: str
) -> None:
    with (
        RunLogWriter(tmp_path / "run.h5", config_yaml="", meta={}) as w,
        pytest.raises(ValueError, match=message),
    ):
        call(w)  # type: ignore[operator]


def test_non_json_detail_names_the_value(tmp_path: Path) -> None:
    with (
        RunLogWriter(tmp_path / "run.h5", config_yaml="", meta={}) as w,
        pytest.raises(TypeError, match="not JSON-serialisable; HINT"),
    ):
        w.log_event(step=0, kind="x", detail={"obj": object()})


def test_meta_may_not_shadow_root_attributes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved: schema_version"):
        RunLogWriter(tmp_path / "run.h5", config_yaml="", meta={"schema_version": 9})
    with pytest.raises(TypeError, match="expected str, int or float"):
        RunLogWriter(tmp_path / "run.h5", config_yaml="", meta={"hosts": ["a"]})  # type: ignore[dict-item]
    assert not (tmp_path / "run.h5").exists()


def test_existing_file_is_kept_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunLogWriter(path, config_yaml="", meta={}) as w:
        _step(w, 0)
    with pytest.raises(FileExistsError, match="HINT"):
        RunLogWriter(path, config_yaml="", meta={})
    RunLogWriter(path, config_yaml="", meta={}, overwrite=True).close()
    assert load(path).steps.empty


def test_resume_keeps_rows_and_logs_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    w = RunLogWriter(path, config_yaml=CONFIG_YAML, meta={"attempt": 1})
    for step in range(3):
        _step(w, step)
    w.log_event(step=1, kind="checkpoint", detail={"step": 1})
    w.flush()
    w._file.close()  # no end event, as a crash leaves it (the SIGKILL case: test_runlog_crash)

    with RunLogWriter(path, config_yaml=CONFIG_YAML, meta={"attempt": 2}, resume=True) as w2:
        _step(w2, 3)
    run = load(path)
    assert run.steps["step"].tolist() == [0, 1, 2, 3]
    assert run.events["kind"].tolist() == ["checkpoint", "restart", "end"]
    restart = run.events["detail"].iloc[1]
    assert restart["resumed_after_step"] == 2
    assert restart["meta"] == {"attempt": 2}
    assert restart["config_changed"] is False
    assert run.attrs["attempt"] == 1  # root attributes are the original run's
    assert run.events["detail"].iloc[0] == {"step": 1}


def test_context_manager_records_the_error(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with (
        pytest.raises(RuntimeError, match="boom"),
        RunLogWriter(path, config_yaml="", meta={}) as w,
    ):
        _step(w, 0)
        raise RuntimeError("boom")
    run = load(path)
    assert run.events["kind"].tolist() == ["error", "end"]
    assert run.events["detail"].iloc[0] == {"type": "RuntimeError", "message": "boom"}
    assert run.end_status == "error"
    assert len(run.steps) == 1
    with pytest.raises(RuntimeError, match="closed"):
        _step(w, 1)


def test_load_rejects_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="HINT"):
        load(path)
    with pytest.raises(FileNotFoundError, match="HINT"):
        load(tmp_path / "missing.h5")


def test_docs_describe_every_dataset_column_and_attribute() -> None:
    text = DOCS.read_text()
    names = [schema.EVENT_DETAIL, *schema.ROOT_ATTRS]
    for spec in schema.TABLES:
        names.append(spec.name)
        names.extend(spec.dtype.names or ())
    missing = [name for name in names if not re.search(rf"`{re.escape(name)}`", text)]
    assert not missing, f"docs/runlog.md does not mention {missing}"
    assert f"schema version {SCHEMA_VERSION}" in text.lower()
