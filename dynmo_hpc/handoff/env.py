"""The environment variables a launcher sets for its ranks (both backends set both)."""

from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCH_TIME_ENV = "DYNMO_LAUNCH_UNIX_S"
"""The launcher's ``time.time()`` when it started the step: rank 0 measures start-up from it."""
ATTEMPT_ENV = "DYNMO_ATTEMPT"
"""0 for a job's first MPI step, then 1, 2, ... (fault injection fires at 0)."""


def attempt(environ: Mapping[str, str] | None = None) -> int:
    """This step's attempt number (:data:`ATTEMPT_ENV`; 0 when unset or empty)."""
    return int((os.environ if environ is None else environ).get(ATTEMPT_ENV, "0") or 0)


def launch_unix_s(environ: Mapping[str, str] | None = None) -> float:
    """When the launcher started this step (:data:`LAUNCH_TIME_ENV`), or NaN when unknown."""
    return float((os.environ if environ is None else environ).get(LAUNCH_TIME_ENV, "nan"))
