"""The ``slurm_cluster`` pytest fixture: a real 4-node SLURM cluster on this machine.

Import it from ``tests/conftest.py`` (``from tests.helpers.slurm_cluster import
slurm_cluster``). Tests that take the fixture talk to the cluster through ``cluster.env``
(SLURM_CONF and friends) in their subprocess calls.

Why these rules:

* The cluster is started by ``scripts/slurm_cluster.sh up`` only where that can work without
  asking anyone: as root with apt-get (it installs Debian's slurm-wlm, munge, MariaDB). Elsewhere
  the SLURM tests skip with a one-line reason, so a laptop run stays green and says why.
* Under CI (``CI=true``) a cluster that cannot start is a failure, not a skip: CI exists to run
  these tests, and a silent skip there would hide a broken bring-up.
* The fixture brings the cluster down at the end of the session only if it started it, so a
  cluster someone started by hand (``make slurm-up``) is left running for them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynmo_hpc.slurm.scheduler import TERMINAL_STATES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
UP_TIMEOUT_S = 900.0
"""A fresh machine first installs about 45 MB of packages (about 30 s); allow for slow mirrors."""


@dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster and the environment that reaches it."""

    state_dir: Path
    """Where scripts/slurm_cluster.sh keeps config, logs and state."""
    env: dict[str, str]
    """``os.environ`` plus the variables of ``<state_dir>/env.sh`` (SLURM_CONF, ...)."""
    started_here: bool
    """True if this session started the cluster (and so stops it at the end)."""

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against the cluster, output captured as text."""
        out = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {out.returncode}\nstdout:\n{out.stdout}\n"
                f"stderr:\n{out.stderr}"
            )
        return out

    def sbatch(
        self, *args: str, cwd: Path | None = None, env: Mapping[str, str] | None = None
    ) -> int:
        """Submit with ``sbatch --parsable ARGS``; returns the job id.

        The job inherits ``env`` (default ``self.env``): sbatch exports the submitter's environment.
        """
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=dict(self.env if env is None else env),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        if out.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def wait(self, job_id: int, *, timeout_s: float = 120.0) -> str:
        """Poll until the job has left the queue, then return its sacct state.

        Polling ``squeue -h -j ID`` is quicker than ``sbatch --wait`` (which polls every ~10 s);
        sacct can lag the queue by a moment, so its state is polled until it is terminal.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queued = self.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False)
            if queued.returncode == 0 and not queued.stdout.strip():
                break
            time.sleep(0.3)
        else:
            self.run(["scancel", str(job_id)], check=False)
            raise AssertionError(f"job {job_id} still queued or running after {timeout_s:.0f} s")
        while True:
            state = self.job_state(job_id)
            if state.split()[0] in TERMINAL_STATES or time.monotonic() >= deadline:
                return state
            time.sleep(0.3)

    def job_state(self, job_id: int) -> str:
        """sacct's State of the job allocation (e.g. ``COMPLETED``, ``CANCELLED by 0``)."""
        out = self.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State"], check=False)
        lines = out.stdout.strip().splitlines()
        return lines[-1].strip() if lines else "UNKNOWN"


def read_env_file(path: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the cluster's env.sh (written without quoting)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            name, _, value = line[len("export ") :].partition("=")
            env[name.strip()] = value.strip()
    return env


def _why_we_cannot_start() -> str | None:
    """None if `slurm_cluster.sh up` can work here, else a one-line reason."""
    if shutil.which("bash") is None:
        return "bash not found"
    if os.name != "posix" or os.geteuid() != 0:
        return "the SLURM test cluster needs root (run as root, or start it: make slurm-up)"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "SLURM is not installed and apt-get is not available to install it"
    return None


def _script(command: str, state_dir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DYNMO_SLURM_DIR": str(state_dir)}
    return subprocess.run(
        ["bash", str(SCRIPT), command],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def _cannot_start(reason: str) -> None:
    """Skip, or fail under CI, where a missing cluster would hide broken tests."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"SLURM test cluster unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running 4-node test cluster (node1..node4, partitions ``shared`` and ``exclusive``)."""
    state_dir = Path(os.environ.get("DYNMO_SLURM_DIR", ROOT / ".slurm")).resolve()
    started_here = False
    if _script("status", state_dir, 60).returncode != 0:
        reason = _why_we_cannot_start()
        if reason is not None:
            _cannot_start(reason)
        try:
            up = _script("up", state_dir, UP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _cannot_start(f"scripts/slurm_cluster.sh up took over {UP_TIMEOUT_S:.0f} s")
        else:
            if up.returncode != 0:
                tail = "\n".join((up.stdout + up.stderr).strip().splitlines()[-15:])
                pytest.fail(f"scripts/slurm_cluster.sh up failed:\n{tail}", pytrace=False)
        started_here = True
    # Run inside an allocation, pytest's own SLURM_* variables would make sbatch/srun think they
    # belong to that job; only the cluster's address is kept.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(read_env_file(state_dir / "env.sh"))
    yield SlurmCluster(state_dir=state_dir, env=env, started_here=started_here)
    if started_here:
        _script("down", state_dir, 120)
