"""A writer killed while rewriting a table's last chunk leaves a file that loads and resumes.

A flush rewrites each table's partly filled last chunk in place, and a SIGKILL during that write
stops it at a page boundary. These tests build exactly that file from two real snapshots: the
file after one flush, with a page-aligned prefix of each rewritten chunk taken from the file
after the next flush. That is what the page cache holds when the kill lands mid-write.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from dynmo_hpc.errors import RunLogError
from dynmo_hpc.runlog import RunLogWriter, load, schema
from dynmo_hpc.runlog.torn_chunk import read_rows

PAGE_BYTES = 4096


def _log_steps(w: RunLogWriter, first: int, stop: int) -> None:
    for step in range(first, stop):
        w.log_step(
            step=step,
            loss=1.0 / (step + 1),
            step_time_s=0.1,
            tokens_per_s=1e4,
            lr=1e-3,
            num_stages=2,
            num_ranks=2,
            num_nodes=1,
        )
        w.log_stage_times(step=step, compute_s=[0.1, 0.2], idle_s=[0.2, 0.1])
        w.log_event(step=step, kind="checkpoint", detail={"step": step, "pad": "x" * step})


def _first_chunk(path: Path) -> dict[str, tuple[int, int]]:
    """Per dataset with rows: (byte offset, stored size) of its first chunk."""
    out = {}
    with h5py.File(path, "r", swmr=True) as f:
        for name, ds in f.items():
            if isinstance(ds, h5py.Dataset) and ds.shape[0]:
                info = ds.id.get_chunk_info(0)
                out[name] = (info.byte_offset, info.size)
    return out


@dataclass(frozen=True)
class Snapshots:
    """The file after flush 1 and after flush 2 (both fill chunk 0 only), written once."""

    before: bytes
    after: bytes
    before_path: Path
    after_path: Path
    chunks: dict[str, tuple[int, int]]
    """:func:`_first_chunk` of ``before_path``."""

    def torn(self, name: str, cut: int) -> bytes:
        """``before`` with dataset ``name``'s first chunk rewritten from ``after`` up to ``cut``."""
        offset, _ = self.chunks[name]
        out = bytearray(self.before)
        out[offset:cut] = self.after[offset:cut]
        return bytes(out)

    def cuts(self, name: str) -> list[int]:
        """Page boundaries inside the chunk where a killed write of it can stop and leave it
        torn: a cut before the first byte the second flush changed (the first rows are the
        same in both) leaves the chunk as it was, with nothing to detect."""
        offset, size = self.chunks[name]
        first = (offset // PAGE_BYTES + 1) * PAGE_BYTES
        return [
            cut
            for cut in range(first, offset + size, PAGE_BYTES)
            if self.after[offset:cut] != self.before[offset:cut]
        ]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Snapshots:
    tmp = tmp_path_factory.mktemp("torn")
    path = tmp / "run.h5"
    w = RunLogWriter(path, config_yaml="job:\n  name: torn\n", meta={"launcher": "test"})
    _log_steps(w, 0, 10)
    w.flush()
    before = path.read_bytes()
    _log_steps(w, 10, 120)
    w.flush()
    after = path.read_bytes()
    w.close()
    (tmp / "before.h5").write_bytes(before)
    (tmp / "after.h5").write_bytes(after)
    return Snapshots(
        before, after, tmp / "before.h5", tmp / "after.h5", _first_chunk(tmp / "before.h5")
    )


def test_the_snapshots_rewrite_chunks_in_place(snapshots: Snapshots) -> None:
    """The premise: the second flush rewrote the first chunks where they were, with new bytes."""
    chunks_before, chunks_after = snapshots.chunks, _first_chunk(snapshots.after_path)
    rewritten = [name for name in chunks_before if chunks_before[name] == chunks_after[name]]
    assert {schema.STEPS.name, schema.EVENTS.name, schema.EVENT_DETAIL} <= set(rewritten)
    for name in rewritten:
        offset, size = chunks_before[name]
        chunk = slice(offset, offset + size)
        assert snapshots.before[chunk] != snapshots.after[chunk], name


def test_a_torn_chunk_loads_the_rows_of_the_last_complete_flush(snapshots: Snapshots) -> None:
    want = load(snapshots.before_path)
    assert len(want.steps) == 10 and len(want.events) == 10
    tried = 0
    for name in (schema.STEPS.name, schema.STAGE_TIMES.name, schema.EVENTS.name):
        cuts = snapshots.cuts(name)
        for cut in sorted({cuts[0], cuts[len(cuts) // 2], cuts[-1]}):
            path = snapshots.before_path.with_name(f"torn_{name}_{cut}.h5")
            path.write_bytes(snapshots.torn(name, cut))
            with h5py.File(path, "r", swmr=True) as f, pytest.raises(OSError, match="filter"):
                f[name][()]  # HDF5 alone refuses the table
            got = load(path)
            for table in ("steps", "stage_times", "layer_costs", "partitions", "events"):
                assert getattr(got, table).equals(getattr(want, table)), (name, cut, table)
            tried += 1
    assert tried >= 6


def test_a_torn_event_detail_chunk_loads_and_a_requeued_job_resumes_from_it(
    snapshots: Snapshots,
) -> None:
    name = schema.EVENT_DETAIL
    path = snapshots.before_path.with_name("torn_detail.h5")
    path.write_bytes(snapshots.torn(name, snapshots.cuts(name)[0]))
    got = load(path)
    assert [e["step"] for e in got.events["detail"]] == list(range(10))
    with RunLogWriter(path, config_yaml="job:\n  name: torn\n", meta={}, resume=True) as w:
        _log_steps(w, 10, 12)
    run = load(path)
    assert run.steps["step"].tolist() == list(range(12))
    assert run.end_status == "ok"
    with h5py.File(path, "r") as f:  # closed cleanly: every chunk passes HDF5's own check
        assert len(f[schema.EVENT_DETAIL][()]) == len(f[schema.EVENT_DETAIL])


@pytest.mark.parametrize("where", ["counted row", "checksum"])
def test_damage_in_a_torn_chunk_is_still_refused(snapshots: Snapshots, where: str) -> None:
    """Only a tear is forgiven: a bit flipped in a row the file counts, or in the stored
    checksum, fails as HDF5 would have failed it."""
    name = schema.STEPS.name
    offset, size = snapshots.chunks[name]
    torn = bytearray(snapshots.torn(name, snapshots.cuts(name)[0]))
    position = (
        offset + 3 * schema.STEPS.dtype.itemsize + 9
        if where == "counted row"
        else (offset + size - 2)
    )
    torn[position] ^= 0x10
    path = snapshots.before_path.with_name(f"torn_damaged_{where.replace(' ', '_')}.h5")
    path.write_bytes(bytes(torn))
    with pytest.raises(RunLogError, match="Fletcher-32"):
        load(path)


def test_read_rows_is_the_plain_read_on_an_intact_table(tmp_path: Path) -> None:
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset(
            "t",
            data=np.arange(5000, dtype=np.int32),
            chunks=(512,),
            maxshape=(None,),
            fletcher32=True,
        )
        assert np.array_equal(read_rows(ds), np.arange(5000, dtype=np.int32))


def test_a_closed_file_gets_no_such_leniency(tmp_path: Path) -> None:
    """Closing completes every write, so in a closed file even a flip past the last row (bytes
    no row holds) is damage, as HDF5 says."""
    path = tmp_path / "closed.h5"
    with RunLogWriter(path, config_yaml="job:\n  name: torn\n", meta={}) as w:
        _log_steps(w, 0, 10)
    offset, _ = _first_chunk(path)[schema.STEPS.name]
    data = bytearray(path.read_bytes())
    data[offset + 20 * schema.STEPS.dtype.itemsize] ^= 0x01  # in row 20; rows 0-9 were written
    path.write_bytes(bytes(data))
    with pytest.raises(RunLogError, match="Fletcher-32"):
        load(path)


def test_the_kill_stress_script_runs(tmp_path: Path) -> None:
    """``benchmarks/stress_runlog_kill.py`` (the real-SIGKILL count in docs/runlog.md) runs and
    reads every file it left; a torn chunk is rare per kill, so how many were torn is not
    asserted."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "stress_runlog_kill.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--kills", "2", "--keep-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kills: 2;" in proc.stdout and "files load() could not read: 0" in proc.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "--kills", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "expected at least 1" in bad.stderr
