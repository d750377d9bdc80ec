"""SIGKILL a run-log writer at random moments; count torn chunks and whether ``load`` reads them.

Each round starts a writer subprocess that logs a step, 8 stage times and an event and flushes,
over and over (so it is nearly always inside a flush, rewriting each table's last chunk), then
kills it with SIGKILL after a random 0.05-0.6 s. The file left behind is read twice:

- every dataset with h5py alone (``ds[()]``): a kill during a chunk's rewrite leaves that chunk
  failing its Fletcher-32 checksum, and HDF5 refuses the dataset (a "torn chunk");
- with :func:`dynmo_hpc.runlog.load`, which must read every file, torn or not, with the steps a
  gap-free prefix.

Prints progress every 50 kills to stderr and the counts at the end; exits 1 if ``load`` failed on
any file. Files with a torn chunk are kept in ``--keep-dir`` when given.

    .venv/bin/python benchmarks/stress_runlog_kill.py --kills 300
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import h5py

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynmo_hpc.errors import RunLogError  # noqa: E402
from dynmo_hpc.runlog import load  # noqa: E402
from dynmo_hpc.runlog.torn_chunk import is_checksum_failure  # noqa: E402

WRITER = textwrap.dedent(
    """
    import sys
    from dynmo_hpc.runlog import RunLogWriter
    with RunLogWriter(sys.argv[1], config_yaml="job: {}\\n", meta={},
                      flush_every_rows=10**9, flush_every_s=1e9) as w:
        print("writing", flush=True)
        step = 0
        while True:
            w.log_step(step=step, loss=1.0, step_time_s=0.1, tokens_per_s=1e4, lr=1e-3,
                       num_stages=8, num_ranks=8, num_nodes=1)
            w.log_stage_times(step=step, compute_s=[0.1] * 8, idle_s=[0.1] * 8)
            w.log_event(step=step, kind="note", detail={"pad": "y" * 300})
            w.flush()
            step += 1
    """
)


def torn_datasets(path: Path) -> list[str]:
    """Datasets h5py alone cannot read because a chunk fails its checksum."""
    torn = []
    with h5py.File(path, "r", swmr=True) as f:
        for name, ds in f.items():
            try:
                ds[()]
            except OSError as exc:
                if not is_checksum_failure(exc):
                    raise
                torn.append(name)
    return torn


def kill_one(work: Path, index: int, rng: random.Random) -> Path:
    """Start a writer, kill it mid-run, return its file."""
    path = work / f"run_{index}.h5"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "writing":
        proc.kill()
        raise SystemExit(f"the writer did not start (rc={proc.wait()})")
    time.sleep(rng.uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=300, help="writers to kill (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill times")
    parser.add_argument("--keep-dir", type=Path, help="keep files with a torn chunk here")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills {args.kills}: expected at least 1")
    rng = random.Random(args.seed)
    num_torn = num_failed = 0
    torn_by_dataset: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dynmo-kill-") as tmp:
        work = Path(tmp)
        for index in range(args.kills):
            path = kill_one(work, index, rng)
            torn = torn_datasets(path)
            for name in torn:
                torn_by_dataset[name] = torn_by_dataset.get(name, 0) + 1
            num_torn += bool(torn)
            try:
                steps = load(path).steps["step"].tolist()
                if steps != list(range(len(steps))):
                    raise RunLogError(f"{path}: steps are not a gap-free prefix")
            except RunLogError as exc:
                num_failed += 1
                print(f"kill {index}: load failed: {exc}", file=sys.stderr)
            if torn and args.keep_dir is not None:
                args.keep_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, args.keep_dir / path.name)
            path.unlink()
            if (index + 1) % 50 == 0:
                print(
                    f"{index + 1}/{args.kills} kills: {num_torn} torn, {num_failed} load failures",
                    file=sys.stderr,
                )
    print(
        f"kills: {args.kills}; files with a torn chunk (h5py alone refuses a dataset): "
        f"{num_torn} {torn_by_dataset}; files load() could not read: {num_failed}"
    )
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
