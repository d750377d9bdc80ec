"""What a failed MPI step says about itself: which rank died, how, and where it was.

Pure functions of the launcher's last output and the ranks' status files
(:mod:`dynmo_hpc.handoff.rank_status`), so the parsing is tested without killing anything. The
launchers word their reports differently; each pattern below matches one of them:

* Open MPI 5 (``prterun``): "process rank 1 with PID 123 on node n1 exited on signal 9", "MPI_ABORT
  was invoked on rank 1 ... Errorcode: 3", "The first process to do so was: ... Exit code: 3";
* SLURM ``srun``: "srun: error: n1: task 1: Killed" / "...: Exited with exit code 3";
* MPICH (Hydra): "RANK 1 PID 123 RUNNING AT n1 = KILLED BY SIGNAL: 9" / "= EXIT CODE: 3".
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass
from typing import Any

_OMPI_SIGNAL = re.compile(
    r"process rank (\d+) with PID (\d+) on node (\S+) exited on\s+signal (\d+)", re.S
)
_OMPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+).*?Errorcode: (-?\d+)", re.S)
_OMPI_EXIT = re.compile(
    r"The first process to do so was:.*?Process name: \[[^\]]*?,(\d+)\].*?"
    r"Exit code:\s*(-?\d+)",
    re.S,
)
_SRUN = re.compile(r"srun: error: (\S+): tasks? (\d+)[^:]*: ([^\n]+)")
_HYDRA = re.compile(
    r"RANK (\d+) PID (\d+) RUNNING AT (\S+)\s*=\s*(KILLED BY SIGNAL: (\d+)|EXIT CODE: (\d+))", re.S
)
_SRUN_SIGNALS = {
    "Killed": signal.SIGKILL,
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Terminated": signal.SIGTERM,
    "Bus error": signal.SIGBUS,
    "Floating point exception": signal.SIGFPE,
}


PHASE_WORDS = {
    "start": "starting up",
    "step": "forward/backward",
    "load_report": "load report",
    "migration": "layer migration",
    "checkpoint": "checkpoint write",
    "done": "finished",
}
"""The phases of :mod:`dynmo_hpc.train.lifecycle` as a person would say them."""


@dataclass(frozen=True)
class StepFailure:
    """One failed MPI step: the launcher's exit code and, where known, the rank that failed."""

    exit_code: int
    cause: str
    """``signal`` (a rank was killed), ``abort`` (MPI_Abort: an exception on a rank),
    ``exit`` (a rank exited non-zero), ``launcher`` (no rank named: the launcher itself)."""
    rank: int | None = None
    signal: int | None = None
    rank_exit_code: int | None = None
    host: str | None = None
    pid: int | None = None
    step: int | None = None
    """The step the failed rank was in (0-based, as in the run log), from its status file;
    messages count from 1, as the progress lines do."""
    phase: str | None = None
    """What it was doing: step, load_report, migration, checkpoint."""

    def signal_name(self) -> str:
        if self.signal is None:
            return ""
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self) -> str:
        """One line for people: "rank 1 (pid 4242 on n1) was killed by SIGKILL at step 7 ..."."""
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        if self.pid is not None or self.host is not None:
            who += f" (pid {self.pid} on {self.host})" if self.pid else f" (on {self.host})"
        if self.cause == "signal":
            what = f"was killed by {self.signal_name()}"
        elif self.cause == "abort":
            what = f"aborted (error code {self.rank_exit_code}; its traceback is above)"
        elif self.cause == "exit":
            what = f"exited with code {self.rank_exit_code}"
        else:
            who, what = "the MPI launcher", f"exited with code {self.exit_code} naming no rank"
        where = ""
        if self.step is not None and self.step >= 0:
            phase = PHASE_WORDS.get(self.phase or "", self.phase)
            where = f" in step {self.step + 1}" + (f" ({phase})" if phase else "")
        return f"{who} {what}{where}"

    def to_event(self) -> dict[str, Any]:
        return {**asdict(self), "signal_name": self.signal_name(), "message": self.describe()}

    def same_as(self, other: StepFailure | None) -> bool:
        """The same rank failing the same way at the same place: a restart will not help."""
        if other is None or self.step is None:
            return False
        keys = ("cause", "rank", "signal", "rank_exit_code", "step", "phase")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def _parse(output: str) -> dict[str, Any]:
    """The failed rank as the launcher reported it (the first report wins)."""
    found: list[tuple[int, dict[str, Any]]] = []
    if m := _OMPI_SIGNAL.search(output):
        found.append(
            (
                m.start(),
                {
                    "cause": "signal",
                    "rank": int(m[1]),
                    "pid": int(m[2]) or None,
                    "host": m[3],
                    "signal": int(m[4]),
                },
            )
        )
    if m := _OMPI_ABORT.search(output):
        found.append(
            (m.start(), {"cause": "abort", "rank": int(m[1]), "rank_exit_code": int(m[2])})
        )
    if m := _OMPI_EXIT.search(output):
        found.append((m.start(), {"cause": "exit", "rank": int(m[1]), "rank_exit_code": int(m[2])}))
    if m := _HYDRA.search(output):
        info: dict[str, Any] = {"rank": int(m[1]), "pid": int(m[2]), "host": m[3]}
        if m[5] is not None:
            info.update(cause="signal", signal=int(m[5]))
        else:
            info.update(cause="exit", rank_exit_code=int(m[6]))
        found.append((m.start(), info))
    if m := _SRUN.search(output):
        text = m[3].strip()
        info = {"rank": int(m[2]), "host": m[1]}
        code = re.match(r"Exited with exit code (\d+)", text)
        if code:
            info.update(cause="exit", rank_exit_code=int(code[1]))
        else:
            sig = _SRUN_SIGNALS.get(text.split(" (")[0])
            info.update(cause="signal", signal=int(sig) if sig else None)
        found.append((m.start(), info))
    return min(found, key=lambda f: f[0])[1] if found else {}


def describe_failure(
    exit_code: int, launcher_output: str, statuses: dict[int, dict[str, Any]]
) -> StepFailure:
    """Put the launcher's report and the ranks' last status together into one failure.

    Without a named rank (an unknown launcher), the step is the furthest any rank got.
    """
    info = _parse(launcher_output)
    if not info:
        info = {"cause": "launcher"}
        if exit_code > 128 and exit_code - 128 < signal.NSIG:
            info = {"cause": "signal", "signal": exit_code - 128}
    rank = info.get("rank")
    status = statuses.get(rank) if rank is not None else None
    if status is None and statuses:
        status = max(statuses.values(), key=lambda s: (int(s.get("step", -1)), s.get("unix_s", 0)))
        if rank is None and info["cause"] == "launcher":
            status = {k: v for k, v in status.items() if k in ("step", "phase")}
    if status is not None:
        info.setdefault("pid", status.get("pid"))
        if info.get("pid") is None:
            info["pid"] = status.get("pid")
        info.setdefault("host", status.get("host"))
        info["step"] = status.get("step")
        info["phase"] = status.get("phase")
    return StepFailure(exit_code=exit_code, **info)
