"""Damaged files fed to the real CLI: every case ends fast with one ``error:`` line, or is intact.

The inputs are copies of a real run's files (a 2-stage tiny job, made once per module):
``run.h5`` truncated to several lengths and with single bits flipped at seeded random positions
(superblock, metadata, data), each checkpoint file (``manifest.json``, ``run_state.json``, a layer
file, ``latest``) likewise, and random bytes or text as the job YAML. Most cases go through the
functions the CLI calls, in-process (a CLI start costs 1-2 s); a sample goes through
``python -m dynmo_hpc`` itself. A flip may land in bytes nothing reads (padding, free space);
then the file must load *identical* to the original, which is a real check: HDF5 checksums
its metadata, the writer adds Fletcher-32 on every table and a CRC-32 over the root attributes,
so a flip that changed any value the loader returns is an error, never a silently wrong report.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint import store
from dynmo_hpc.errors import CheckpointError, ConfigError, RunLogError
from dynmo_hpc.isolation import IsolatedCrash, IsolatedTimeout, call_isolated
from dynmo_hpc.runlog import RunLog, RunLogWriter, load, precheck, reader, schema
from dynmo_hpc.runlog.report import summarize
from tests.helpers.jobs import ROOT, run_job, tiny_config

CLI_TIMEOUT_S = 30.0
"""A CLI call that takes longer hangs: the test fails instead of waiting."""
LOAD_LIMIT_S = 5.0
"""An in-process load of a damaged copy must end (error or data) within this."""
FLIPS_PER_REGION = {"superblock": 12, "metadata": 60, "data": 40}


def needs_a_run(test: Any) -> Any:
    """Marks a test that uses :func:`real_run` (a 2-rank training job)."""
    return pytest.mark.mpi(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real 2-stage run with checkpoints step_2 and step_4, its run log loaded once."""
    out = tmp_path_factory.mktemp("fuzz")
    checkpoints = ["checkpoint.every_steps=2", "checkpoint.at_end=true", "checkpoint.keep=3"]
    cfg = tiny_config(out, "pipeline.num_stages=2", *checkpoints)
    run_job(cfg)
    run_log = cfg.run_dir / "run.h5"
    original = load(run_log)
    return {
        "cfg": cfg,
        "run_dir": cfg.run_dir,
        "run_log": run_log,
        "bytes": run_log.read_bytes(),
        "original": original,
        "summary": summarize(original),
        "job": cfg.run_dir / "config.yaml",
    }


def _cli_env() -> dict[str, str]:
    """This checkout first on the path (the venv's editable install may point elsewhere)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "DYNMO_LOG_LEVEL": "WARNING"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m dynmo_hpc ARGS``; fails the test on a hang."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "dynmo_hpc", *args],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            cwd=ROOT,
            env=_cli_env(),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"dynmo-hpc {' '.join(args)} hung (over {CLI_TIMEOUT_S:g} s)")


def _assert_clean_failure(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Non-zero exit, no traceback, the last stderr line is ``error: ...; HINT: ...``."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-2000:]
    assert "Traceback" not in output, output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "HINT:" in last, proc.stderr[-2000:]
    for needle in needles:
        assert needle in last, last
    return last


def _same_run_log(got: RunLog, want: RunLog) -> bool:
    if got.attrs != want.attrs or got.config != want.config:
        return False
    tables = ("steps", "stage_times", "layer_costs", "partitions", "events")
    return all(getattr(got, name).equals(getattr(want, name)) for name in tables)


def _flip(data: bytes, position: int, bit: int) -> bytes:
    out = bytearray(data)
    out[position] ^= 1 << bit
    return bytes(out)


def _load_outcome(path: Path, original: RunLog) -> str:
    """'error' (a RunLogError with a HINT) or 'same'; anything else fails the test."""
    t0 = time.monotonic()
    try:
        run = load(path)
    except RunLogError as exc:
        assert "HINT:" in str(exc) and "\n" not in str(exc), str(exc)
        outcome = "error"
    else:
        assert _same_run_log(run, original), f"{path}: loaded, but not the original's data"
        outcome = "same"
    assert time.monotonic() - t0 < LOAD_LIMIT_S, f"{path}: took {time.monotonic() - t0:.1f} s"
    return outcome


# -- run.h5 -----------------------------------------------------------------------------------


@needs_a_run
def test_truncated_run_logs_are_refused_at_once(real_run: dict[str, Any], tmp_path: Path) -> None:
    data = real_run["bytes"]
    for length in (0, 1, 8, 47, 48, 100, 1024, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut_{length}.h5"
        path.write_bytes(data[:length])
        t0 = time.monotonic()
        with pytest.raises(RunLogError, match="HINT:"):
            load(path)
        assert time.monotonic() - t0 < 1.0, f"truncated to {length} bytes: slow"


@needs_a_run
def test_bit_flipped_run_logs_fail_or_load_identical(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    data, original = real_run["bytes"], real_run["original"]
    rng = random.Random(20261201)
    regions = {"superblock": (0, 48), "metadata": (48, 8192), "data": (8192, len(data))}
    outcomes: dict[str, Counter[str]] = {name: Counter() for name in regions}
    path = tmp_path / "flipped.h5"
    for region, (start, end) in regions.items():
        for _ in range(FLIPS_PER_REGION[region]):
            position = rng.randrange(start, end)
            path.write_bytes(_flip(data, position, rng.randrange(8)))
            outcomes[region][_load_outcome(path, original)] += 1
    # Every superblock byte is covered by its checksum; most metadata and data bytes are read.
    assert outcomes["superblock"] == Counter(error=FLIPS_PER_REGION["superblock"]), outcomes
    assert outcomes["metadata"]["error"] > FLIPS_PER_REGION["metadata"] // 2, outcomes
    assert outcomes["data"]["error"] > FLIPS_PER_REGION["data"] // 2, outcomes


def _mark_open_for_write(data: bytes) -> bytes:
    """The file as a killed writer leaves it: consistency flags set, superblock re-checksummed."""
    out = bytearray(data)
    out[11] = precheck.SWMR_WRITE_FLAGS
    out[44:48] = precheck.lookup3(bytes(out[:44])).to_bytes(4, "little")
    return bytes(out)


@needs_a_run
def test_a_killed_writers_file_with_damaged_metadata_is_stopped_by_the_timeout(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    """An SWMR open retries a failed metadata checksum for a long time; the child is killed."""
    killed = _mark_open_for_write(real_run["bytes"])
    path = tmp_path / "killed.h5"
    path.write_bytes(killed)
    assert _same_run_log(load(path), real_run["original"])  # intact: read with SWMR
    # A writer that reopened the file between the precheck and the open: retried with SWMR.
    assert _same_run_log(reader._read(path, False, False), real_run["original"])
    rng = random.Random(7)
    stopped = 0
    for _ in range(3):
        path.write_bytes(_flip(killed, rng.randrange(48, 2048), rng.randrange(8)))
        t0 = time.monotonic()
        try:
            load(path, timeout_s=2.0)
        except RunLogError as exc:
            stopped += "took over 2 s" in str(exc)
        assert time.monotonic() - t0 < 4.0
    assert stopped >= 1, "expected at least one SWMR retry loop to be cut by the timeout"


@needs_a_run
def test_report_cli_on_damaged_run_logs(real_run: dict[str, Any], tmp_path: Path) -> None:
    data = real_run["bytes"]
    cases = {
        "empty.h5": b"",
        "kib.h5": data[:1024],
        "half.h5": data[: len(data) // 2],
        "superblock.h5": _flip(data, 30, 2),
        "metadata.h5": _flip(data, 700, 5),
        "data.h5": _flip(data, len(data) - 5000, 0),
        "text.h5": b"steps: 4\n",
    }
    messages = {}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        messages[name] = _assert_clean_failure(_cli("report", str(path), "--out", str(tmp_path)))
    assert "not an HDF5 file" in messages["empty.h5"] and "not an HDF5" in messages["text.h5"]
    assert "is truncated" in messages["kib.h5"] and "is truncated" in messages["half.h5"]
    assert "superblock fails its checksum" in messages["superblock.h5"]
    # The intact file: exit 0 and the summary the in-process loader gives.
    good = tmp_path / "good" / "run.h5"
    good.parent.mkdir()
    good.write_bytes(data)
    proc = _cli("report", str(good.parent), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    written = (tmp_path / "report" / "summary.txt").read_text()
    assert written == real_run["summary"].replace(str(real_run["run_log"]), str(good))


# -- foreign HDF5 files and bad config_yaml (no training needed) -------------------------------


def _small_run_log(path: Path, config_yaml: str = "job:\n  name: small\n") -> Path:
    row = {"step": 0, "loss": 1.0, "step_time_s": 0.1, "tokens_per_s": 1e3, "lr": 1e-3}
    with RunLogWriter(path, config_yaml=config_yaml, meta={}) as w:
        w.log_step(**row, num_stages=1, num_ranks=1, num_nodes=1)
    return path


def test_foreign_hdf5_files_are_named_as_such(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "plain.h5", "w") as f:  # superblock version 0, other tools' default
        f["steps"] = np.arange(4)
    with h5py.File(tmp_path / "tables.h5", "w", libver="v110") as f:
        f.attrs["schema_version"] = 2
        f["steps"] = np.arange(4)
    h5py.File(tmp_path / "empty.h5", "w").close()
    for name in ("plain.h5", "empty.h5"):
        with pytest.raises(RunLogError, match=r"not a dynmo_hpc run log.*HINT: pass the run\.h5"):
            load(tmp_path / name)
    with pytest.raises(RunLogError, match="not a dynmo_hpc run log, or a damaged one"):
        load(tmp_path / "tables.h5")
    last = _assert_clean_failure(_cli("report", str(tmp_path / "plain.h5")))
    assert "not a dynmo_hpc run log" in last and "version that wrote it" not in last


def _set_attrs(path: Path, **attrs: Any) -> None:
    """Change root attributes and re-seal the CRC, as a buggy or foreign writer would."""
    with h5py.File(path, "a") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        current = {key: value for key, value in f.attrs.items()}
        f.attrs[schema.ATTRS_CRC_ATTR] = schema.attrs_crc32(current)


@pytest.mark.parametrize(
    ("config_yaml", "problem"),
    [
        ("job: [unclosed\n", "is not valid YAML"),
        ("- job\n- model\n", "it is not a mapping"),
        ("just some words", "it is not a mapping"),
        ("job: 5\n", "has section 'job' that is not a mapping"),
        (7, "is of type int, not text"),
    ],
)
def test_bad_config_yaml_attribute_is_a_clear_error(
    tmp_path: Path, config_yaml: Any, problem: str
) -> None:
    path = _small_run_log(tmp_path / "run.h5")
    _set_attrs(path, config_yaml=config_yaml)
    with pytest.raises(RunLogError) as info:
        load(path)
    assert "config_yaml attribute" in str(info.value) and problem in str(info.value)
    assert "HINT:" in str(info.value)


def test_changed_attributes_fail_their_crc(tmp_path: Path) -> None:
    path = _small_run_log(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        f.attrs["config_yaml"] = "job:\n  name: smal1\n"  # valid YAML, silently different
    with pytest.raises(RunLogError, match=r"root attributes .* fail their CRC-32"):
        load(path)


def test_bad_config_yaml_through_the_cli(tmp_path: Path) -> None:
    path = _small_run_log(tmp_path / "run.h5")
    _set_attrs(path, config_yaml="job: {name: [\n")
    last = _assert_clean_failure(_cli("report", str(path), "--out", str(tmp_path / "r")))
    assert "config_yaml attribute is not valid YAML" in last


def test_the_writer_refuses_to_append_to_a_damaged_run_log(tmp_path: Path) -> None:
    """Rank 0 on resume: no fork there, so the precheck and a non-SWMR open must do."""
    data = _small_run_log(tmp_path / "good.h5").read_bytes()
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = 1
    foreign = (tmp_path / "foreign.h5").read_bytes()
    cases = {
        "half": (data[: len(data) // 2], "is truncated"),
        "kib": (data[:1024], "is truncated"),
        "superblock": (_flip(data, 20, 1), "superblock fails its checksum"),
        "metadata": (_flip(data, 300, 3), "cannot"),
        "foreign": (foreign, "not a dynmo_hpc run log"),
        "text": (b"hello", "not an HDF5 file"),
    }
    for case, (content, problem) in cases.items():
        path = tmp_path / case / "run.h5"
        path.parent.mkdir()
        path.write_bytes(content)
        t0 = time.monotonic()
        with pytest.raises(RunLogError, match="HINT:") as info:
            RunLogWriter(path, config_yaml="", meta={}, resume=True)
        assert problem in str(info.value), (case, str(info.value))
        assert time.monotonic() - t0 < 2.0, case
        assert sorted(p.name for p in path.parent.iterdir()) == ["run.h5"], case  # no temp file
        assert path.read_bytes() == content, case  # left as it was


def _forked_children(pid: int) -> list[int]:
    """Children of ``pid`` that are forks of it (same command line), not programs it ran: the
    imports run ``uname -p`` in a child of their own, which must not pass for the reader."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    parent_cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    forks = []
    for child in children:
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes() == parent_cmdline:
                forks.append(int(child))
        except FileNotFoundError:  # it exited meanwhile
            pass
    return forks


def test_ctrl_c_stops_a_report_stuck_on_a_damaged_file(tmp_path: Path) -> None:
    """The parent waits on a pipe, so SIGINT gets through even while the HDF5 child loops."""
    path = _small_run_log(tmp_path / "run.h5")
    killed = bytearray(_mark_open_for_write(path.read_bytes()))
    for position in range(300, 340):  # an object header: SWMR retries its checksum at length
        killed[position] ^= 0xFF
    path.write_bytes(bytes(killed))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynmo_hpc", "report", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_cli_env(),
        # A user's Ctrl-C reaches a foreground command, whose SIGINT is not ignored; a test suite
        # started in the background by a non-interactive shell inherits SIGINT ignored, which
        # would make this command ignore it too until something installs a handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and not _forked_children(proc.pid):
        time.sleep(0.1)  # until the reading child is forked: past the imports, into the read
    assert _forked_children(proc.pid), "the reader child was never forked"
    time.sleep(0.5)
    assert proc.poll() is None, "the damaged file should keep the reader busy (SWMR retries)"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - t0 < 3.0
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


# -- the isolated reader itself -----------------------------------------------------------------


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _segfault() -> None:
    os.kill(os.getpid(), 11)


def _raise_key_error() -> None:
    raise KeyError("boom")


def _raise_run_log_error() -> None:
    raise RunLogError("bad; HINT: fix")


def test_isolated_call_returns_times_out_and_reports_crashes() -> None:
    assert call_isolated(sum, [1, 2, 3], timeout_s=10) == 6
    t0 = time.monotonic()
    with pytest.raises(IsolatedTimeout):
        call_isolated(_sleep_forever, timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    with pytest.raises(IsolatedCrash, match="SIGSEGV"):
        call_isolated(_segfault, timeout_s=10)
    with pytest.raises(IsolatedCrash, match="KeyError: 'boom'") as info:
        call_isolated(_raise_key_error, timeout_s=10)
    assert "_raise_key_error" in info.value.child_traceback
    with pytest.raises(RunLogError, match="bad; HINT: fix"):
        call_isolated(_raise_run_log_error, timeout_s=10)


def test_lookup3_matches_hdf5s_superblock_checksum(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "a.h5", "w", libver="v110") as f:
        f["x"] = 1
    raw = (tmp_path / "a.h5").read_bytes()[:48]
    assert precheck.lookup3(raw[:44]) == int.from_bytes(raw[44:48], "little")
    assert precheck.lookup3(b"") == 0xDEADBEEF


# -- checkpoints ------------------------------------------------------------------------------


def _copy_checkpoints(real_run: dict[str, Any], tmp_path: Path) -> Path:
    root = tmp_path / "run" / "checkpoint"
    shutil.copytree(real_run["run_dir"] / "checkpoint", root)
    return root


def _damage_cases(data: bytes, rng: random.Random, flips: int) -> list[tuple[str, bytes]]:
    cases = [(f"cut{n}", data[:n]) for n in sorted({0, 1, len(data) // 2, len(data) - 1})]
    for _ in range(flips):
        position = rng.randrange(len(data))
        cases.append((f"flip{position}", _flip(data, position, rng.randrange(8))))
    return cases


@needs_a_run
@pytest.mark.parametrize("name", ["manifest.json", "run_state.json", "layer_0001.pt"])
def test_damaged_checkpoint_files_are_refused_and_the_previous_one_used(
    real_run: dict[str, Any], tmp_path: Path, name: str
) -> None:
    root = _copy_checkpoints(real_run, tmp_path)
    newest = root / "step_4"
    original = (newest / name).read_bytes()
    rng = random.Random(name)
    for case, content in _damage_cases(original, rng, flips=12):
        (newest / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=f"{newest}.*HINT:") as info:
            store.resolve(newest)
        assert "\n" not in str(info.value), case
        chosen, skipped = store.resolve(root.parent)
        assert chosen.path == root / "step_2", case
        assert [c.path for c in skipped] == [newest], case
    (newest / name).write_bytes(original)
    assert store.resolve(root.parent)[0].path == newest


def _forge(directory: Path, name: str, content: bytes) -> None:
    """Write ``content`` and make the manifest agree, so only the file's own checks can object."""
    (directory / name).write_bytes(content)
    manifest = json.loads((directory / store.MANIFEST).read_text())
    manifest["files"][name] = store.write_file(directory, name, content)
    (directory / store.MANIFEST).write_text(json.dumps(manifest))


@needs_a_run
def test_manifest_with_wrong_types_or_names_is_refused(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    root = _copy_checkpoints(real_run, tmp_path)
    newest = root / "step_4"
    good = json.loads((newest / store.MANIFEST).read_text())
    files = good["files"]
    fake = {"bytes": 1, "crc32": 1}
    bad = {
        "list": ([], "not a JSON object"),
        "no files": ({"format": 1}, "no 'files' object"),
        "files list": ({**good, "files": ["run_state.json"]}, "no 'files' object"),
        "text bytes": ({**good, "files": {**files, "run_state.json": {"bytes": "9"}}}, "integer"),
        "escape": ({**good, "files": {**files, "../x": fake}}, "'../x'"),
        "gap": ({**good, "files": {k: v for k, v in files.items() if "2" not in k}}, "not 0..4"),
        "step": ({**good, "step": 7}, "for step 7"),
        "format": ({**good, "format": 99}, "format 99"),
    }
    for case, (manifest, problem) in bad.items():
        (newest / store.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="cannot be resumed from") as info:
            store.resolve(newest)
        assert problem in str(info.value), (case, str(info.value))


@needs_a_run
def test_run_state_with_wrong_types_is_refused(real_run: dict[str, Any], tmp_path: Path) -> None:
    root = _copy_checkpoints(real_run, tmp_path)
    newest = root / "step_4"
    good = json.loads((newest / store.RUN_STATE).read_text())
    bad = {
        "not json": b"{step: 4",
        "list": b"[1, 2]",
        "no step": json.dumps({k: v for k, v in good.items() if k != "step"}).encode(),
        "text step": json.dumps({**good, "step": "4"}).encode(),
        "other step": json.dumps({**good, "step": 3}).encode(),
        "no parts": json.dumps({k: v for k, v in good.items() if k != "parts"}).encode(),
        "bad parts": json.dumps({**good, "parts": [0, 5, 2, 6]}).encode(),
        "no identity": json.dumps({k: v for k, v in good.items() if k != "identity"}).encode(),
        "bad history": json.dumps({**good, "history": {"losses": "x"}}).encode(),
        "bad costs": json.dumps({**good, "balancer": {"costs_s": {"a": 1}}}).encode(),
        "deep": b"[" * 100_000,
    }
    for case, content in bad.items():
        _forge(newest, store.RUN_STATE, content)
        assert store.verify(newest) is None, case  # the manifest agrees: forged
        with pytest.raises(CheckpointError, match=r"cannot be resumed from: run_state\.json.*HINT"):
            store.read_run_state(newest)


@needs_a_run
def test_layer_file_that_passes_its_crc_but_is_no_layer(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    root = _copy_checkpoints(real_run, tmp_path)
    newest = root / "step_4"
    _forge(newest, "layer_0001.pt", random.Random(1).randbytes(5000))
    with pytest.raises(
        CheckpointError, match=r"layer_0001\.pt cannot be read as a torch file.*HINT"
    ):
        store.load_layer(newest, 1)
    other = root.parent / "other.pt"
    torch.save({"format": 1, "index": 3, "module": {}, "optimizer": {}}, other)
    _forge(newest, "layer_0001.pt", other.read_bytes())
    with pytest.raises(CheckpointError, match="is not layer 1's checkpoint payload"):
        store.load_layer(newest, 1)


@needs_a_run
def test_latest_pointer_damage_is_reported_and_scanning_decides(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    root = _copy_checkpoints(real_run, tmp_path)
    latest = root / store.LATEST
    cases = {
        b"step_9\n": "names step_9, which does not exist",
        b"\xff\xfe\x00": "unreadable",
        b"../../etc\n": "not a step_<n> name",
        b"": "not a step_<n> name",
    }
    for content, problem in cases.items():
        latest.write_bytes(content)
        chosen, skipped = store.resolve(root.parent)
        assert chosen.path == root / "step_4"
        assert [c.path for c in skipped] == [latest] and problem in (skipped[0].problem or "")
    latest.write_bytes(b"step_9\n")
    for step_dir in root.glob("step_*"):
        (step_dir / store.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="latest: the latest pointer names step_9"):
        store.resolve(root.parent)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.resolve(tmp_path / "nowhere")


@needs_a_run
def test_resume_cli_refuses_damage_before_any_rank_starts(
    real_run: dict[str, Any], tmp_path: Path
) -> None:
    job = str(real_run["job"])
    out = ["--set", f"job.out_dir={tmp_path / 'out'}"]
    root = _copy_checkpoints(real_run, tmp_path)
    newest = root / "step_4"
    (newest / "layer_0003.pt").write_bytes((newest / "layer_0003.pt").read_bytes()[:1000])
    (root / "step_2" / store.MANIFEST).write_bytes(b"\x00garbage")
    (root / store.LATEST).write_bytes(b"step_9\n")
    t0 = time.monotonic()
    last = _assert_clean_failure(_cli("run", job, *out, "--resume", str(newest)))
    assert "layer_0003.pt has 1000 bytes" in last
    last = _assert_clean_failure(_cli("run", job, *out, "--resume", str(root.parent)))
    assert "no intact checkpoint" in last and "step_9" in last and "not valid JSON" in last
    # A damaged run log in the job's run directory: refused before the ranks would append to it.
    good = real_run["run_dir"] / "checkpoint" / "step_4"
    run_dir = tmp_path / "out" / real_run["cfg"].job.name
    run_dir.mkdir(parents=True)
    (run_dir / "run.h5").write_bytes(real_run["bytes"][:4096])
    last = _assert_clean_failure(_cli("run", job, *out, "--resume", str(good)))
    assert "cannot resume: the run log" in last and "is truncated" in last
    assert not (run_dir / "result.json").exists()
    assert time.monotonic() - t0 < 3 * CLI_TIMEOUT_S


# -- the job YAML ------------------------------------------------------------------------------


def _random_job_texts(rng: random.Random, count: int) -> list[bytes]:
    alphabet = "abcjobmodel: -[]{}\n\t'\"#&*!|>%@,.0123456789"
    texts = []
    for i in range(count):
        size = rng.randrange(0, 400)
        if i % 2:
            texts.append(rng.randbytes(size))
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(size)).encode())
    return texts


def test_random_job_files_are_config_errors_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    for content in _random_job_texts(random.Random(3), 200):
        path.write_bytes(content)
        with pytest.raises(ConfigError) as info:
            config_mod.load(path)
        message = str(info.value)
        assert "HINT:" in message and "\n" not in message, message


def test_run_and_sbatch_cli_on_random_job_files(tmp_path: Path) -> None:
    """(``dynmo-hpc plan`` reads no files: costs and stages come as arguments.)"""
    texts = _random_job_texts(random.Random(4), 2)
    for index, content in enumerate([*texts, b"\x89HDF\r\n\x1a\n" + bytes(40)]):
        path = tmp_path / f"job{index}.yaml"
        path.write_bytes(content)
        _assert_clean_failure(_cli("run", str(path)))
    _assert_clean_failure(_cli("sbatch", str(tmp_path / "job1.yaml")))
