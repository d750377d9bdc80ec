"""Run one function in a forked child with a deadline: for reading files that may be damaged.

Why a process and not a thread or an alarm: a C library (HDF5 here) that loops or sleeps on
corrupt input does so while holding the GIL, so no Python-level timeout or Ctrl-C gets through,
and one that dereferences garbage takes the interpreter down. A forked child shares nothing the
parent needs; the parent waits on a pipe (interruptible), and on the deadline, a Ctrl-C or a
crash it kills or reaps the child and raises. Fork, not spawn: the child starts in microseconds
with every module already imported, and the result comes back pickled.

Not for MPI ranks: forking a process that holds an MPI library's state (shared-memory segments,
network endpoints) is unsafe; ranks check files with the cheap, in-process prechecks instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from dynmo_hpc.errors import DynmoError

T = TypeVar("T")

_READ_CHUNK_BYTES = 1 << 20


class IsolatedTimeout(Exception):
    """The child did not finish before its deadline and was killed."""


class IsolatedCrash(Exception):
    """The child died (a signal, a failed exit) or raised something other than a DynmoError."""

    def __init__(self, message: str, child_traceback: str = "") -> None:
        super().__init__(message)
        self.child_traceback = child_traceback


def _child(fn: Callable[..., Any], args: tuple[Any, ...], write_fd: int) -> None:
    """Run ``fn`` and send ``("ok", result)``, ``("error", DynmoError)`` or ``("crash", ...)``."""
    code = 0
    # The parent reports a crash in one line; Python's fault handler (pytest enables it) would
    # dump the child's stacks on top.
    faulthandler.disable()
    try:
        try:
            outcome: tuple[str, Any] = ("ok", fn(*args))
        except DynmoError as exc:
            outcome = ("error", exc)
        except BaseException as exc:  # the parent turns it into IsolatedCrash
            outcome = ("crash", (f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view) :]
    except BaseException:
        code = 3
    finally:
        os._exit(code)  # no atexit handlers, no finalizers of the parent's objects (open files)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _read_all(read_fd: int, deadline: float, timeout_s: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise IsolatedTimeout(f"no result after {timeout_s:g} s")
        ready, _, _ = select.select([read_fd], [], [], left_s)
        if not ready:
            continue
        chunk = os.read(read_fd, _READ_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def call_isolated(fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """``fn(*args)`` computed in a forked child; its DynmoErrors are re-raised here.

    ``fn``, its arguments and its result must be picklable (the result and the exception travel
    back through a pipe).

    Raises:
        IsolatedTimeout: ``fn`` ran past ``timeout_s`` seconds (the child was killed).
        IsolatedCrash: the child died or raised anything but a DynmoError.
        DynmoError: what ``fn`` raised.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        os.close(read_fd)
        _child(fn, args, write_fd)
    os.close(write_fd)
    deadline = time.monotonic() + timeout_s
    try:
        data = _read_all(read_fd, deadline, timeout_s)
    except BaseException:  # Ctrl-C or the deadline: never leave the child behind
        _kill(pid)
        raise
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise IsolatedCrash(f"the reading process died of {name}")
    try:
        kind, value = pickle.loads(data)
    except Exception:
        raise IsolatedCrash(
            f"the reading process exited ({os.waitstatus_to_exitcode(status)}) without a result"
        ) from None
    if kind == "ok":
        result: T = value
        return result
    if kind == "error":
        raise value
    message, child_traceback = value
    raise IsolatedCrash(message, child_traceback)
