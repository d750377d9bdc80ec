"""One MPI step as a child process: its stderr teed and kept, signals passed on, nothing orphaned.

Both launch paths start the step (``mpiexec`` locally, ``srun``/``mpirun`` in an allocation)
through :class:`StepProcess`:

* **stderr is teed**: passed through to ours as it comes, and its tail kept, because that is
  where the launcher says which rank died and how (:mod:`dynmo_hpc.launch.failure`);
* **its own session**: a Ctrl-C in the terminal reaches only us, and we decide what the ranks
  get (SIGUSR2: checkpoint at the next step boundary and stop);
* **no orphans**: the launcher gets SIGTERM if we die (``PR_SET_PDEATHSIG``), and
  :meth:`StepProcess.kill_all` ends every process of its session, not only the launcher: Open MPI
  puts each rank in its own process group, so a process-group kill would miss them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

TAIL_BYTES = 64 * 1024
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def session_pids(session_id: int) -> list[int]:
    """Every live process whose session is ``session_id`` (Linux ``/proc``; empty elsewhere)."""
    pids: list[int] = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        # after the command: state, ppid, pgrp, session, ...
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == session_id:
            pids.append(int(entry.name))
    return pids


class StepProcess:
    """A started MPI step. ``wait``, ``send`` a signal, ``kill_all``; ``tail`` its stderr."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            start_new_session=True,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._tail = bytearray()
        self._tee = threading.Thread(target=self._copy_stderr, name="step-stderr", daemon=True)
        self._tee.start()

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            if out is not None:
                with contextlib.suppress(OSError, ValueError):
                    out.write(chunk)
                    out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            self._tail += chunk
            if len(self._tail) > TAIL_BYTES:
                del self._tail[: len(self._tail) - TAIL_BYTES]

    def tail(self) -> str:
        """The last ``TAIL_BYTES`` of its stderr (after it ended: all of it, up to that size)."""
        self._tee.join(timeout=5)
        return self._tail.decode(errors="replace")

    def poll(self) -> int | None:
        return self.proc.poll()

    def has_ended(self) -> bool:
        """Whether the launcher has exited, without reaping it (``WNOWAIT``): safe in a signal
        handler that interrupted a ``wait`` of the same process, which holds Popen's lock."""
        if self.proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def wait(self, timeout_s: float | None = None) -> int:
        return self.proc.wait(timeout=timeout_s)

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    def kill_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``, to every process of the step's session."""
        session = self.proc.pid
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pid in {session, *session_pids(session)}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not session_pids(session):
                    return
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
