"""The project's one error base class, so callers catch user errors without catching bugs.

Every error a user can cause (a bad job file, a missing MPI, a cluster that cannot hold the
job, a checkpoint that does not fit) derives from :class:`DynmoError`. Messages say what was
expected, what was found, and end with ``HINT: <how to fix it>``. The CLI prints them as one
``error:`` line with a non-zero exit; anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class DynmoError(Exception):
    """A problem the user can fix; the message names it and ends with a HINT."""


class ConfigError(DynmoError, ValueError):
    """The job file or an override is invalid (names the key, the file and the fix)."""


class DataError(DynmoError, ValueError):
    """Text or token data cannot be prepared or read (names the file, the problem and the fix)."""


class LaunchError(DynmoError, RuntimeError):
    """The ranks could not be started, or the job failed or timed out."""


class SubmitError(LaunchError):
    """SLURM rejected the job, or cannot satisfy it (names what the cluster offers)."""


class CheckpointError(DynmoError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or incompatible with the job."""


class RunLogError(DynmoError, ValueError):
    """A run log is missing, damaged, not a dynmo_hpc run log, or unreadable by this version."""


class Interrupted(DynmoError):
    """A command was asked to stop (Ctrl-C, SIGTERM, SIGHUP) and stopped: not an error of the
    user's input, but the command must not carry on to its next piece of work. The CLI prints
    the message and exits ``128 + signum``, as a shell does for a process a signal ended."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
