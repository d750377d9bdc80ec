"""What a submitit job runs: the job manager, as a submitit *checkpointable*.

SLURM warns a job with SIGUSR2 before its time limit or a preemption (``--signal=B:USR2@N``).
submitit catches that signal in the batch process and calls :meth:`ManagerJob.checkpoint`:
it asks the training step to write a checkpoint at its next step boundary and end, then
returns the same call with ``resume=True``. submitit saves that call, runs ``scontrol requeue``
and exits; when SLURM starts the job again, the manager continues from that checkpoint, and the
run log gains a ``restart`` event in the same file.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.logging_utils import setup_logging
from dynmo_hpc.slurm.manager import ActiveStep, run_manager
from dynmo_hpc.slurm.scheduler import SubmitError

log = logging.getLogger(__name__)


class ManagerJob:
    """The submitit callable: ``ManagerJob()(config_path, launcher, loopback_only)``."""

    def __call__(
        self,
        config_path: str,
        launcher: str,
        loopback_only: bool,
        resume: bool | None = None,
        resume_path: str | None = None,
    ) -> dict[str, Any]:
        """Run the manager once in the batch script; returns rank 0's ``result.json``.

        Raising on a failed job makes it FAILED in SLURM (submitit exits non-zero), so sacct and
        ``job.state`` tell the truth. ``resume_path``: the checkpoint the first run continues
        from (``submit --resume``); a requeued run continues from the newest.
        """
        setup_logging(0)
        outcome = run_manager(
            config_path,
            launcher=launcher,
            loopback_only=loopback_only,
            resume=resume,
            resume_path=resume_path,
            handle_preemption=False,
        )
        run_dir = Path(config_path).parent
        result_path = run_dir / "result.json"
        if outcome.exit_code != 0 or not result_path.is_file():
            last = outcome.failures[-1].describe() if outcome.failures else "no rank named"
            raise SubmitError(
                f"training step exited with code {outcome.exit_code} ({last}; "
                f"{outcome.gave_up or 'not restarted'}; result.json "
                f"{'written' if result_path.is_file() else 'missing'}); run directory "
                f"{run_dir}. HINT: the failing rank's output is in this job's stderr log"
            )
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result

    def checkpoint(
        self,
        config_path: str,
        launcher: str,
        loopback_only: bool,
        resume: bool | None = None,
        resume_path: str | None = None,
    ) -> Any:
        """submitit's preemption hook: checkpoint the running step, then resubmit resuming."""
        import submitit

        cfg = config_mod.load(config_path)
        grace_s = max(10.0, cfg.slurm.signal_delay_s - 10.0)
        log.warning(
            "preemption or time limit: the training step checkpoints and ends (up to %.0f s)",
            grace_s,
        )
        ActiveStep.stop(signal.SIGUSR2)
        if not ActiveStep.wait_stopped(grace_s):
            log.error("the step did not end within %.0f s; requeueing without waiting", grace_s)
        return submitit.helpers.DelayedSubmission(
            ManagerJob(), config_path, launcher, loopback_only, True
        )


def run_in_allocation(config_path: str, launcher: str, loopback_only: bool) -> dict[str, Any]:
    """The manager once in the batch script (no requeue hook); see :class:`ManagerJob`."""
    return ManagerJob()(config_path, launcher, loopback_only)
