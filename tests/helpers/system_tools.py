"""Debian command-line tools a test needs (e.g. ``h5dump`` of ``hdf5-tools``), got on demand.

Same policy as the SLURM cluster fixture: as root with ``apt-get`` the package is installed
(``make test`` on a fresh machine needs nothing else); elsewhere the test skips with the reason;
under CI (``CI=true``) a tool that cannot be had is a failure, because CI exists to run the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

_APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def _apt_install(package: str) -> str | None:
    """Install ``package`` with apt-get; None on success, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root with apt-get, so it cannot be installed here"
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    out = subprocess.run(install, capture_output=True, text=True, env=_APT_ENV, timeout=600)
    if out.returncode != 0:  # the package lists may be missing or stale: refresh once
        subprocess.run(["apt-get", "update"], capture_output=True, env=_APT_ENV, timeout=600)
        out = subprocess.run(install, capture_output=True, text=True, env=_APT_ENV, timeout=600)
    if out.returncode != 0:
        return f"apt-get install {package} failed: {out.stderr.strip()[-500:]}"
    return None


def require_tool(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` first if it is missing."""
    path = shutil.which(binary)
    if path is None:
        problem = _apt_install(package)
        path = shutil.which(binary)
        if path is None:
            reason = f"{binary} (Debian package {package}) is missing: {problem or 'not found'}"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
    return path
