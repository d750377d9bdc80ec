"""What one pipeline stage may hold in memory, from the allocation rather than the hardware.

Why not the machine's RAM: under SLURM a job gets ``--mem`` (``SLURM_MEM_PER_NODE``) and the
cgroup the step runs in enforces it; in a container the cgroup limit is the real ceiling. A pack
planned against the physical RAM could put more layers on a stage than the job may hold, and the
packed step would be killed. On a GPU the free device memory is what a stage can grow into, less
a headroom for the allocator's fragmentation and the CUDA context.

Everything here is a pure function of numbers and file texts; :func:`read_cgroup_limit_bytes` is
the one reader of ``/proc`` and ``/sys``, kept tiny.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

CGROUP_UNLIMITED_BYTES = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (about 2^63, page-rounded); anything above this
is treated as no limit."""
DEVICE_HEADROOM_FRACTION = 0.1
"""Of the device's total memory, kept free on a GPU: allocator fragmentation, the CUDA context,
the transient buffers of a step."""


def slurm_mem_per_node_bytes(environ: Mapping[str, str]) -> int | None:
    """``SLURM_MEM_PER_NODE`` (megabytes, as SLURM sets it for ``--mem``) in bytes; None when
    unset, empty, not a number or 0 (``--mem=0``: all of the node's memory)."""
    text = environ.get("SLURM_MEM_PER_NODE", "").strip()
    if not text.isdigit() or int(text) == 0:
        return None
    return int(text) * 1024 * 1024


def parse_cgroup_limit(text: str) -> int | None:
    """A cgroup memory limit file's value in bytes (v2 ``memory.max``: a number or ``max``; v1
    ``memory.limit_in_bytes``: a number, huge when unlimited); None when there is no limit."""
    value = text.strip()
    if not value.isdigit():
        return None
    limit = int(value)
    return limit if 0 < limit < CGROUP_UNLIMITED_BYTES else None


def cgroup_limit_paths(proc_self_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> list[Path]:
    """Where this process's memory limit may be, most specific first, from ``/proc/self/cgroup``:
    the v2 group (``0::/path``), the v1 memory controller's group (``N:memory:/path``), then the
    mount's root (a container sees its own group there)."""
    paths: list[Path] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        group = group.lstrip("/")
        if controllers == "":
            paths.append(root / group / "memory.max")
        elif "memory" in controllers.split(","):
            paths.append(root / "memory" / group / "memory.limit_in_bytes")
    paths += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    return list(dict.fromkeys(paths))


def read_cgroup_limit_bytes(
    read_text: Callable[[Path], str] = lambda p: p.read_text(),
) -> int | None:
    """This process's cgroup memory limit in bytes, or None (no cgroup, no limit, unreadable).
    The first readable file of :func:`cgroup_limit_paths` decides."""
    try:
        own = read_text(Path("/proc/self/cgroup"))
    except OSError:
        own = ""
    for path in cgroup_limit_paths(own):
        try:
            text = read_text(path)
        except OSError:
            continue
        return parse_cgroup_limit(text)
    return None


def host_capacity_bytes(
    physical_bytes: float,
    ranks_on_host: int,
    *,
    slurm_mem_bytes: int | None = None,
    cgroup_limit_bytes: int | None = None,
) -> float:
    """Per stage on a CPU host: the smallest of the physical RAM, ``--mem`` and the cgroup
    limit, shared by the ranks on the host (they all count against the same limit)."""
    limits = [physical_bytes, slurm_mem_bytes, cgroup_limit_bytes]
    usable = min(float(x) for x in limits if x is not None and x > 0)
    return usable / max(1, ranks_on_host)


def device_capacity_bytes(
    free_bytes: float,
    total_bytes: float,
    own_reserved_bytes: float,
    headroom_fraction: float = DEVICE_HEADROOM_FRACTION,
) -> float:
    """Per stage on a GPU: what this stage holds now (its allocator's reserve) plus what is
    free on the device, less ``headroom_fraction`` of the total; never below 0.

    The free memory alone would count this stage's own layers as taken; the total alone would
    count other processes' memory as available."""
    return max(0.0, free_bytes + own_reserved_bytes - headroom_fraction * total_bytes)
