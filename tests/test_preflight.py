"""Preflight: files, devices, launchers and venvs that cannot work are refused before any rank
starts, with one error line; the ranks' data loader refuses the same files the same way."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli import main
from dynmo_hpc.config import ConfigError, DataSection, JobConfig
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.errors import LaunchError
from dynmo_hpc.launch import preflight

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = ROOT / "jobs" / "default.yaml"
TEXT = "The quick brown fox jumps over the lazy dog.\n" * 20  # 900 bytes of UTF-8


def job(tmp_path: Path, *overrides: str) -> JobConfig:
    return config_mod.load(DEFAULT_JOB, [f"job.out_dir={tmp_path / 'runs'}", *overrides])


def with_data(cfg: JobConfig, path: Path | str | None, **changes: object) -> JobConfig:
    """The job reading ``path`` (set after loading: the file may change after validation)."""
    data = dataclasses.replace(cfg.data, path=None if path is None else str(path), **changes)
    return dataclasses.replace(cfg, data=data)


def one_line(exc: pytest.ExceptionInfo[Exception]) -> str:
    message = str(exc.value)
    assert "\n" not in message and "HINT:" in message, message
    return message


def test_a_good_job_passes_locally_and_for_slurm(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = job(tmp_path, f"data.path={corpus}", "model.seq_len=32")
    preflight.check_job(cfg)
    preflight.check_job(cfg, for_slurm=True)
    preflight.check_job(with_data(cfg, None))  # the default corpus


def _bad_corpora(tmp_path: Path) -> list[tuple[Path, str]]:
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.dat").write_bytes(b"\x7fELF\x02\x01\x00\x00" + b"text" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (tmp_path / "short.txt").write_text("tiny text")
    return [
        (tmp_path / "missing.txt", r"does not exist; HINT: give a UTF-8 text file"),
        (tmp_path / "dir.txt", r"is a directory without meta.json; HINT: give a directory written"),
        (tmp_path / "empty.txt", r"is empty; HINT: give a file with text in it"),
        (tmp_path / "binary.dat", r"has a NUL byte at offset 6: a binary file, not text; HINT"),
        (tmp_path / "latin1.txt", r"is not UTF-8 text \(byte 3: b'\\xe9'\); HINT: convert it"),
        (
            tmp_path / "short.txt",
            r"training split has 9 bytes but model.seq_len=32 needs at least 34",
        ),
    ]


def test_bad_data_files_are_refused_by_preflight_and_by_the_ranks_alike(tmp_path: Path) -> None:
    cfg = job(tmp_path, "model.seq_len=32", "data.val_fraction=0")
    for path, pattern in _bad_corpora(tmp_path):
        with pytest.raises(ConfigError, match=pattern) as before:
            preflight.check_job(with_data(cfg, path))
        assert f"data.path={str(path)!r}" in one_line(before) or "split" in str(before.value)
        # The ranks meet the same file with the same function, so the same message.
        with pytest.raises(ConfigError) as on_rank:
            TextDataset.from_config(DataSection(path=str(path), val_fraction=0.0), 32)
        assert str(on_rank.value) == str(before.value)


def test_a_validation_split_too_short_for_one_sequence_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)  # 900 bytes: 10 % is 90 bytes of validation, seq_len 100 needs 102
    cfg = with_data(job(tmp_path, "model.seq_len=100"), corpus, val_fraction=0.1)
    with pytest.raises(ConfigError, match=r"validation split has 90 bytes .* data.val_fraction=0"):
        preflight.check_job(cfg)
    preflight.check_job(with_data(cfg, corpus, val_fraction=0.0))  # the fix the hint names
    dataset = TextDataset.from_config(DataSection(path=str(corpus), val_fraction=0.0), 100)
    assert len(dataset.train) == 900 and len(dataset.val) == 0


def test_crlf_text_trains_on_newlines_as_before(tmp_path: Path) -> None:
    corpus = tmp_path / "crlf.txt"
    corpus.write_bytes(b"line one\r\nline two\rline three\n" * 10)
    dataset = TextDataset.from_config(DataSection(path=str(corpus), val_fraction=0.0), 8)
    assert b"\r" not in dataset.train.tobytes()
    assert dataset.train.tobytes() == corpus.read_text().encode()


def test_cuda_without_a_gpu_is_refused_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchError, match=r"runtime.device=cuda but torch sees no CUDA device"):
        preflight.check_job(job(tmp_path, "runtime.device=cuda"))
    preflight.check_job(job(tmp_path, "runtime.device=auto"))
    # On SLURM the submit host's GPUs say nothing; the job must ask for GPUs instead.
    with pytest.raises(ConfigError, match=r"slurm.gpus_per_node=0: the nodes would get no GPU"):
        preflight.check_job(job(tmp_path, "runtime.device=cuda"), for_slurm=True)
    preflight.check_job(
        job(tmp_path, "runtime.device=cuda", "slurm.gpus_per_node=1"), for_slurm=True
    )


def test_run_directory_entries_of_the_wrong_kind_are_refused(tmp_path: Path) -> None:
    cfg = job(tmp_path)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint").write_text("not a directory")
    with pytest.raises(LaunchError, match=r"checkpoint is a file, not a directory") as info:
        preflight.check_job(cfg)
    one_line(info)
    (run_dir / "checkpoint").unlink()
    (run_dir / "config.yaml").mkdir()
    with pytest.raises(LaunchError, match=r"config.yaml is a directory"):
        preflight.check_job(cfg)
    (run_dir / "config.yaml").rmdir()
    run_dir.rmdir()
    run_dir.write_text("a file where the run directory goes")
    with pytest.raises(LaunchError, match=r"is a file, but the run directory goes there"):
        preflight.check_job(cfg)


def test_a_run_directory_the_file_system_cannot_hold_is_refused(tmp_path: Path) -> None:
    cfg = config_mod.load(DEFAULT_JOB, [f"job.out_dir={tmp_path / ('d' * 5000)}"])
    with pytest.raises(LaunchError, match=r"cannot be checked \(File name too long\); HINT"):
        preflight.check_job(cfg)


def test_mpi_launcher_must_be_an_executable_file(tmp_path: Path) -> None:
    script = tmp_path / "mpiexec"
    script.write_text("#!/bin/sh\n")
    for launcher, pattern in [
        ("/no/such/mpiexec", r"runtime.mpi_launcher='/no/such/mpiexec': mpiexec not found there"),
        ("no-such-mpiexec-on-path", r"mpiexec not found there; HINT"),
        (str(tmp_path), r"is not an executable file; HINT"),
        (str(script), r"is not an executable file; HINT"),
    ]:
        with pytest.raises(LaunchError, match=pattern) as info:
            preflight.check_job(job(tmp_path, f"runtime.mpi_launcher={launcher}"))
        one_line(info)
    script.chmod(0o755)
    preflight.check_job(job(tmp_path, f"runtime.mpi_launcher={script}"))
    preflight.check_job(job(tmp_path, "runtime.mpi_launcher=sh"))  # a command on PATH


def test_slurm_venv_must_be_a_virtual_environment(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    with pytest.raises(ConfigError, match=r"slurm.venv=.* is not a directory; HINT: create it"):
        preflight.check_job(job(tmp_path, f"slurm.venv={venv}"), for_slurm=True)
    (venv / "bin").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"has no bin/python: not a virtual environment"):
        preflight.check_job(job(tmp_path, f"slurm.venv={venv}"), for_slurm=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(ConfigError, match=r"has no bin/activate"):
        preflight.check_job(job(tmp_path, f"slurm.venv={venv}"), for_slurm=True)
    (venv / "bin" / "activate").write_text("")
    preflight.check_job(job(tmp_path, f"slurm.venv={venv}"), for_slurm=True)
    preflight.check_job(job(tmp_path, f"slurm.venv={venv / 'gone'}"))  # local runs ignore it


@pytest.mark.parametrize("command", ["sbatch", "submit"])
def test_slurm_commands_run_preflight_before_anything_is_queued(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    extra = ["--submit"] if command == "sbatch" else []
    out_dir = tmp_path / "runs"
    argv = [command, str(DEFAULT_JOB), *extra, "--set", f"job.out_dir={out_dir}"]
    rc = main([*argv, "--set", f"data.path={empty}"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: data.path=") and "is empty; HINT:" in err
    rc = main([*argv, "--set", f"slurm.venv={tmp_path / 'no-venv'}"])
    _, err = capsys.readouterr()
    assert rc == 2 and "slurm.venv=" in err and "is not a directory; HINT" in err
    assert not out_dir.exists()  # nothing was written, nothing queued


def test_a_job_name_sbatch_cannot_take_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["sbatch", str(DEFAULT_JOB), "--set", f"job.out_dir={tmp_path}", "--set", "job.name=it's"]
    )
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: invalid sbatch options:")
    assert 'job_name="it\'s" has characters sbatch cannot take' in err and "HINT:" in err
    assert os.listdir(tmp_path) == []
