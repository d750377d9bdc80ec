"""Checks that need the file system or the hardware, made once before any rank starts.

Why: config validation (:mod:`dynmo_hpc.config`) is pure and runs everywhere, the ranks too; it
cannot know that ``data.path`` is a binary file, that this machine has no GPU, or that
``<run_dir>/checkpoint`` is a stray file. Found on the ranks, each of these costs a launch (on
SLURM, a queue wait) and ends as a traceback per rank; found here it is one ``error:`` line.

:func:`check_job` is called by :func:`dynmo_hpc.launch.local.run_local` (``dynmo-hpc run``),
by ``dynmo-hpc sbatch --submit`` and by :func:`dynmo_hpc.slurm.submit.submit` (with
``for_slurm=True``); the SLURM manager repeats the data, run-directory and device checks on
the node. torch is only
imported when ``runtime.device`` is ``cuda`` on a local run or ``model.init_from`` names a
Hugging Face checkpoint (its tensors are checked here), so the SLURM commands stay light.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.data_source import TOKEN_FILE_SUFFIX
from dynmo_hpc.data.corpus import read_corpus, split_sizes
from dynmo_hpc.errors import ConfigError, LaunchError
from dynmo_hpc.handoff.signal_budget import SignalBudget, measured_budget

log = logging.getLogger(__name__)


def check_job(cfg: JobConfig, *, for_slurm: bool = False) -> None:
    """Refuse a job whose data, device, run directory, MPI launcher or venv cannot work.

    ``for_slurm``: the job runs on compute nodes, not here. The local-only checks (this
    machine's GPU, ``runtime.mpi_launcher``) are replaced by what the allocation needs
    (``slurm.venv`` with ``bin/python`` and ``bin/activate``; GPUs requested for a CUDA job).

    Raises:
        ConfigError: ``data.path`` is unusable, or the job's settings contradict each other.
        LaunchError: the run directory, the device or the MPI launcher cannot be used.
    """
    check_data(cfg)
    if cfg.model.init_from is not None:  # every tensor present with its shape, none left over
        from dynmo_hpc.model.hf_weights import HFCheckpoint, check_checkpoint

        check_checkpoint(cfg.model, HFCheckpoint(cfg.model.init_from))
    try:
        check_run_dir(cfg.run_dir)
    except OSError as exc:  # a name too long for the file system, a permission error
        raise LaunchError(
            f"the run directory {cfg.run_dir} cannot be checked ({exc.strerror}); HINT: choose "
            "another job.out_dir or job.name"
        ) from None
    if for_slurm:
        check_slurm_device(cfg)
        check_venv(cfg.slurm.venv)
        warn_signal_budget(cfg)
    else:
        check_local_device(cfg.runtime.device)
        check_mpi_launcher(cfg.runtime.mpi_launcher)


def check_data(cfg: JobConfig) -> None:
    """The data can train the model: byte text is a non-empty UTF-8 file long enough for one
    sequence per split (the same functions the ranks' :class:`~dynmo_hpc.data.batches.TextDataset`
    uses); token data is checked, and a ``data.tokenizer`` prepared once, by
    :func:`~dynmo_hpc.data.source.check_source` (imported here only then: it needs numpy)."""
    data = cfg.data
    if data.tokenizer is None and (data.path is None or not _token_data(data.path)):
        corpus = read_corpus(data.path)
        _, num_val = split_sizes(len(corpus), data.val_fraction, cfg.model.seq_len)
    else:
        from dynmo_hpc.data.source import check_source

        num_val = check_source(data, cfg.model.seq_len, cfg.model.vocab_size, cfg.job.out_dir)
    if cfg.train.eval_interval and num_val == 0:
        raise ConfigError(
            f"train.eval_interval={cfg.train.eval_interval} scores validation windows, but the "
            "data has no validation split; HINT: set data.val_fraction (e.g. 0.1), or "
            "train.eval_interval=0"
        )


def _token_data(path: str) -> bool:
    """Whether ``data.path`` names token ids (a ``.bin`` file or a prepared directory)."""
    return path.endswith(TOKEN_FILE_SUFFIX) or Path(path).is_dir()


def check_run_dir(run_dir: Path) -> None:
    """``<out_dir>/<name>`` and what the launch writes in it must be directories where they
    exist (config.yaml a file): a stray file there fails the first checkpoint, minutes in."""
    for path in (run_dir.parent, run_dir):
        if path.exists() and not path.is_dir():
            raise LaunchError(
                f"{path} is a file, but the run directory goes there; HINT: move the file "
                "away, or choose another job.out_dir or job.name"
            )
    checkpoint = run_dir / "checkpoint"
    if checkpoint.exists() and not checkpoint.is_dir():
        raise LaunchError(
            f"{checkpoint} is a file, not a directory; checkpoints are written into it. "
            "HINT: move the file away (or delete it)"
        )
    config = run_dir / "config.yaml"
    if config.is_dir():
        raise LaunchError(
            f"{config} is a directory; the resolved job config is written there. HINT: move "
            "the directory away"
        )


def check_local_device(device: str) -> None:
    """``runtime.device=cuda`` needs a CUDA device on this machine."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise LaunchError(
            "runtime.device=cuda but torch sees no CUDA device here (a CPU-only torch build, no "
            "GPU, or CUDA_VISIBLE_DEVICES hides them); HINT: use runtime.device=auto or cpu"
        )


def check_slurm_device(cfg: JobConfig) -> None:
    """A CUDA job on SLURM must ask for GPUs (the submit host's own GPUs say nothing)."""
    if cfg.runtime.device == "cuda" and cfg.slurm.gpus_per_node == 0:
        raise ConfigError(
            "runtime.device=cuda but slurm.gpus_per_node=0: the nodes would get no GPU; "
            "HINT: set slurm.gpus_per_node (e.g. 1), or runtime.device=auto"
        )


def check_mpi_launcher(mpi_launcher: str | None) -> None:
    """``runtime.mpi_launcher`` (a path, or a command on PATH) must be an executable file."""
    if mpi_launcher is None:
        return
    found = mpi_launcher if os.sep in mpi_launcher else shutil.which(mpi_launcher)
    where = f"runtime.mpi_launcher={mpi_launcher!r}"
    if found is None or not Path(found).exists():
        raise LaunchError(
            f"{where}: mpiexec not found there; HINT: give the path of an mpiexec, or null for "
            "the venv's (make venv installs it)"
        )
    if Path(found).is_dir() or not os.access(found, os.X_OK):
        raise LaunchError(
            f"{where} is not an executable file; HINT: give the path of mpiexec itself (e.g. "
            ".venv/bin/mpiexec), or null for the venv's"
        )


def check_venv(venv: str | None) -> None:
    """``slurm.venv`` must be a virtual environment: the job sources ``bin/activate`` and runs
    ``python`` from it."""
    if venv is None:
        return
    where = f"slurm.venv={venv!r}"
    root = Path(venv)
    if not root.is_dir():
        raise ConfigError(
            f"{where} is not a directory; HINT: create it (python -m venv {venv}) or set "
            "slurm.venv: null to use the one running now"
        )
    for name in ("bin/python", "bin/activate"):
        if not (root / name).is_file():
            raise ConfigError(
                f"{where} has no {name}: not a virtual environment; HINT: recreate it "
                f"(python -m venv {venv}) or point slurm.venv at one"
            )


def warn_signal_budget(cfg: JobConfig) -> SignalBudget | None:
    """At submit time: warn when the run log already in the run directory (the run this job
    continues) measured a step plus a checkpoint longer than ``slurm.signal_delay_s``.

    A new run has no measurement yet; rank 0 checks again once it has one (run log event
    ``signal_budget``). Returns the budget when it does not fit, else None. An unreadable run
    log only skips the check: it is not this check's to refuse.
    """
    path = cfg.run_dir / "run.h5"
    if not path.is_file():
        return None
    try:
        from dynmo_hpc import runlog

        run = runlog.load(path)
        step_times_s = [float(t) for t in run.steps["step_time_s"]]
        events = run.events[run.events["kind"] == "checkpoint"]["detail"]
        checkpoint_times_s = [float(d["seconds"]) for d in events]
    except Exception as exc:  # any damage means no measurement
        log.debug("no signal budget from %s: %s", path, exc)
        return None
    budget = measured_budget(step_times_s, checkpoint_times_s, cfg.slurm.signal_delay_s)
    if budget is None or budget.fits():
        return None
    log.warning("warning: %s (measured in %s)", budget.problem(), path)
    return budget
