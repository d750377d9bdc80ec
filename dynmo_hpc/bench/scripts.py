"""What the ``benchmarks/*.py`` scripts share: their output files and their rank programs.

Why: each script wrote its ``--json``/``--json-out``/``--markdown-out`` file and started its
own rank program on local MPI ranks with the same few lines; here they are once.

- :func:`write_text_out` and :func:`write_json_out` write an output file atomically
  (:mod:`dynmo_hpc.atomic_io`: an interrupted script never leaves half a table under the
  real name), and do nothing when the flag was not given (``path`` None). The bytes are the
  caller's: the JSON's indent and final newline are parameters, so each script's files stay
  as they were.
- :func:`run_rank_program` starts a script's own ``--rank`` mode on local MPI ranks, as
  :mod:`dynmo_hpc.launch.local` starts a job's ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynmo_hpc.atomic_io import atomic_write_text


def write_text_out(path: Path | None, text: str) -> None:
    """Write ``text`` to ``path`` atomically (its directory created); nothing if None."""
    if path is not None:
        atomic_write_text(path, text)


def write_json_out(
    path: Path | None, value: object, *, indent: int | None = 1, newline: bool = True
) -> None:
    """``json.dumps(value, indent=indent)`` (a final newline unless ``newline`` is False) to
    ``path`` atomically; nothing if None."""
    write_text_out(path, json.dumps(value, indent=indent) + ("\n" if newline else ""))


def run_rank_program(
    script: str,
    argv: Sequence[str],
    *,
    num_ranks: int = 2,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``script --rank ARGV`` on ``num_ranks`` local MPI ranks; its exit code.

    Each rank runs under ``python -m mpi4py``, so one failing rank aborts the job instead of
    deadlocking it. The ranks' own log is quiet (``DYNMO_LOG_LEVEL=WARNING``): the script
    prints its table. ``env`` adds to (or overrides) that environment.
    """
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, fresh_session_dir

    rank_argv = [sys.executable, "-m", "mpi4py", script, "--rank", *argv]
    spec = LaunchSpec(num_ranks, rank_argv, env={"DYNMO_LOG_LEVEL": "WARNING", **(env or {})})
    launcher = LocalMpiLauncher()
    with fresh_session_dir() as session_dir:  # as the launcher's own runs
        env_all = launcher.environment(spec, session_dir)
        return subprocess.run(launcher.command(spec), env=env_all, check=False).returncode
