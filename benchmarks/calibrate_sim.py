"""Calibrate `dynmo-hpc simulate` against real runs on this machine, and report how close it is.

What it does, in order:
  1. measures two machine constants directly: the optimizer's CPU seconds per parameter (gradient
     norm, clipping scale, AdamW step, on the default model's layers, in this process) and the
     link between two MPI ranks (one-way time of activation-sized and tiny messages, waiting the
     way the trainer waits);
  2. runs the calibration jobs (2 and 4 ranks; plain, MoD, MoE, imbalanced; M = 4 and 8; 1F1B
     and GPipe; static, and two imbalanced runs that migrate under `optimal` and `diffusion`),
     short ones, one at a time, or takes those already in --runs-dir with --reuse;
  3. splits each run's measured step per stage (dynmo_hpc.sim.overheads.decompose);
  4. for each run, fits the per-step, per-action and per-report overheads on the OTHER runs
     (leave one out), writes them with step 1's constants to a machine file and runs
     `dynmo-hpc simulate --from RUN --machine FILE --wall-per-cpu run` with the run's policy
     (each step's wall-per-CPU ratio from the run log's stage times: layers only);
  5. prints the table: run, stages, M, schedule, measured median step, predicted, ratio (and the
     uncalibrated compute-only prediction's ratio); --write-machine saves the constants fitted
     on all runs.

    PYTHONPATH=. .venv/bin/python benchmarks/calibrate_sim.py --runs-dir /tmp/calib_runs \\
        [--reuse] [--only plain_p2_m4,...] [--write-machine FILE] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynmo_hpc import config as config_mod  # noqa: E402
from dynmo_hpc.bench.scripts import write_json_out  # noqa: E402
from dynmo_hpc.calibrate.short_runs import ShortRun, short_run_config  # noqa: E402
from dynmo_hpc.cli import main as cli_main  # noqa: E402
from dynmo_hpc.pipeline.comm import WAIT_MAX_SLEEP_S  # noqa: E402
from dynmo_hpc.runlog import load  # noqa: E402
from dynmo_hpc.sim.machine import MachineModel, save_machine  # noqa: E402
from dynmo_hpc.sim.overheads import RunDecomposition, decompose, fit_overheads  # noqa: E402

STEPS = 12
INTERVAL = 4
MICRO_BATCH_SIZE = 2
"""Small microbatches keep each run to tens of seconds on a shared 2-core machine."""


def calibration_run(
    name: str,
    job: str,
    num_stages: int,
    num_microbatches: int,
    *,
    schedule: str = "1f1b",
    algorithm: str = "static",
) -> ShortRun:
    """A calibration run: ``STEPS`` steps, a load report every ``INTERVAL``, small microbatches."""
    return ShortRun(
        name,
        job,
        num_stages,
        num_microbatches,
        algorithm,
        steps=STEPS,
        interval=INTERVAL,
        schedule=schedule,
        extra=(f"train.micro_batch_size={MICRO_BATCH_SIZE}",),
    )


RUNS: tuple[ShortRun, ...] = (
    calibration_run("plain_p2_m4", "default", 2, 4),
    calibration_run("plain_p2_m8", "default", 2, 8),
    calibration_run("plain_p2_m8_gpipe", "default", 2, 8, schedule="gpipe"),
    calibration_run("plain_p4_m4", "default", 4, 4),
    calibration_run("plain_p4_m8", "default", 4, 8),
    calibration_run("mod_p2_m8", "stress/mod", 2, 8),
    calibration_run("mod_p4_m8", "stress/mod", 4, 8),
    calibration_run("moe_p2_m4", "stress/moe", 2, 4),
    calibration_run("moe_p4_m8", "stress/moe", 4, 8),
    calibration_run("imbalanced_p2_m8", "imbalanced", 2, 8),
    # Dynamic policies: the trainer migrates at its load reports, the replay decides with the
    # same rule on the same costs and prices the move; measured steps include the migrations.
    calibration_run("imbalanced_p2_m8_optimal", "imbalanced", 2, 8, algorithm="optimal"),
    calibration_run("imbalanced_p4_m8_diffusion", "imbalanced", 4, 8, algorithm="diffusion"),
)


# --- 1. machine constants measured directly ----------------------------------------------------


def measure_optimizer_s_per_param(repeats: int = 7) -> float:
    """Thread CPU seconds per parameter of what the trainer does per layer after the schedule
    (:meth:`Trainer.step`): squared gradient norm, clipping scale, learning rate, AdamW step,
    zero_grad; summed over the default model's layers, median of ``repeats``."""
    import torch

    from dynmo_hpc.model.optim import build_optimizer, scale_grads_, set_lr, squared_grad_norm
    from dynmo_hpc.model.schemes import build_layer

    torch.set_num_threads(1)
    cfg = config_mod.load(ROOT / "jobs" / "default.yaml", [])
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    optimizers = [build_optimizer(layer, cfg.train) for layer in layers]
    num_params = sum(p.numel() for layer in layers for p in layer.parameters())
    totals = []
    for rep in range(repeats + 2):  # two warm-up rounds: AdamW allocates its state on the first
        total_s = 0.0
        for layer, optimizer in zip(layers, optimizers, strict=True):
            for p in layer.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            t0 = time.thread_time()
            squared_grad_norm(layer)
            scale_grads_([layer], 0.5)
            set_lr(optimizer, cfg.train.lr)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total_s += time.thread_time() - t0
        if rep >= 2:
            totals.append(total_s)
    return statistics.median(totals) / num_params


PINGPONG_SIZES_BYTES = (8, 131072, 1 << 20)
"""A tiny message (latency), one activation of the calibration runs (2 x 128 x 128 x 4 bytes)
and a larger one (bandwidth)."""


def pingpong_rank(out: Path, round_trips: int = 40) -> None:
    """Rank program (``mpiexec -n 2``): median one-way seconds per message size, waiting with
    the trainer's own :func:`~dynmo_hpc.pipeline.comm.wait_quietly` (so a sleeping receiver's
    wake-up is in it, as it is in a pipeline step)."""
    import torch
    from mpi4py import MPI

    from dynmo_hpc.pipeline.comm import wait_quietly

    comm = MPI.COMM_WORLD
    peer = 1 - comm.rank
    result: dict[str, float] = {}
    for size in PINGPONG_SIZES_BYTES:
        send = torch.zeros(size, dtype=torch.uint8)
        recv = torch.empty(size, dtype=torch.uint8)
        one_way = []
        for _ in range(round_trips + 3):
            wait_quietly([comm.Ibarrier()])
            t0 = time.perf_counter()
            if comm.rank == 0:
                wait_quietly([comm.Isend(send, dest=peer, tag=1)])
                wait_quietly([comm.Irecv(recv, source=peer, tag=2)])
            else:
                wait_quietly([comm.Irecv(recv, source=peer, tag=1)])
                wait_quietly([comm.Isend(send, dest=peer, tag=2)])
            one_way.append((time.perf_counter() - t0) / 2)
        result[str(size)] = statistics.median(one_way[3:])
    if comm.rank == 0:
        out.write_text(json.dumps(result))


def measure_link() -> tuple[float, float, dict[str, float]]:
    """(latency_s, bandwidth_bytes_per_s, one-way seconds per size) from a 2-rank ping-pong."""
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pingpong.json"
        launcher = LocalMpiLauncher()
        cmd = launcher.command(
            LaunchSpec(
                num_ranks=2,
                rank_argv=[sys.executable, str(Path(__file__).resolve()), "--pingpong", str(out)],
            )
        )
        env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, check=True, env=env, timeout=300, stdout=subprocess.DEVNULL)
        one_way = {k: float(v) for k, v in json.loads(out.read_text()).items()}
    small, large = PINGPONG_SIZES_BYTES[0], PINGPONG_SIZES_BYTES[-1]
    latency_s = one_way[str(small)]
    extra_s = one_way[str(large)] - latency_s
    bandwidth = (large - small) / extra_s if extra_s > 0 else float("inf")
    return latency_s, min(bandwidth, 1e12), one_way


# --- 2-5. runs, decomposition, leave-one-out prediction ----------------------------------------


def ensure_run(run: ShortRun, runs_dir: Path, reuse: bool) -> Path:
    """The run's run.h5, training it first unless --reuse finds a finished one."""
    from dynmo_hpc.launch.local import launch_local

    path = runs_dir / run.name / "run.h5"
    if reuse and path.exists() and load(path).end_status == "ok":
        return path
    print(f"running {run.name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rc, run_dir = launch_local(
        short_run_config(run, ROOT / "jobs", runs_dir), timeout_s=900, overwrite=True
    )
    if rc != 0:
        raise SystemExit(f"calibration run {run.name} failed with exit code {rc}")
    print(f"  {run.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return run_dir / "run.h5"


def simulate_json(argv: list[str]) -> dict[str, Any]:
    """``dynmo-hpc simulate ARGV --json`` in this process; its parsed output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["simulate", *argv, "--json"])
    if rc != 0:
        raise SystemExit(f"dynmo-hpc simulate {' '.join(argv)} exited {rc}")
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def predict(
    path: Path, policy: str, machine: MachineModel | None, wall_per_cpu: str | None = "run"
) -> float:
    """Median simulated step of ``policy`` replaying ``path`` with ``machine`` (none: no
    overheads, no link) and ``--wall-per-cpu wall_per_cpu`` (None: not given, i.e. 1)."""
    argv = ["--from", str(path), "--algorithms", policy]
    if wall_per_cpu is not None:
        argv += ["--wall-per-cpu", wall_per_cpu]
    if machine is None:
        return float(simulate_json([*argv, "--machine", "none"])[policy]["step_time_s"])
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "machine.json"
        save_machine(machine, file)
        return float(simulate_json([*argv, "--machine", str(file)])[policy]["step_time_s"])


def machine_from(
    fit_runs: list[RunDecomposition],
    optimizer_s_per_param: float,
    link: tuple[float, float],
    cores: float | None,
) -> MachineModel:
    return MachineModel(
        overheads=fit_overheads(fit_runs, optimizer_s_per_param),
        latency_s=link[0],
        bandwidth_bytes_per_s=link[1],
        cores=cores,
        poll_max_s=WAIT_MAX_SLEEP_S,
        notes={"fitted_on": [r.name for r in fit_runs]},
    )


def print_decomposition(decomps: list[RunDecomposition]) -> None:
    print("\nper stage, medians over steps (s): wall in layers / CPU in layers / idle / rest")
    print(f"{'run':<20}{'k':>6}  stages")
    for d in decomps:
        cells = "  ".join(
            f"[{c:.3f}/{u:.3f}/{i:.3f}/{r:.3f}]"
            for c, u, i, r in zip(d.compute_s, d.layer_cpu_s, d.idle_s, d.rest_s, strict=True)
        )
        print(f"{d.name:<20}{d.wall_s_per_cpu_s:>6.2f}  {cells}")
    print(f"{'run':<20}{'step':>8}{'rest0 cpu':>11}{'report wall':>13}{'max params':>12}")
    for d in decomps:
        print(
            f"{d.name:<20}{d.step_s:>8.3f}{d.rest_cpu_s:>11.4f}{d.report_extra_s:>13.4f}"
            f"{max(d.stage_params):>12d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pingpong", type=Path, help=argparse.SUPPRESS)  # the rank program
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/calib_runs"))
    parser.add_argument("--reuse", action="store_true", help="keep finished runs in --runs-dir")
    parser.add_argument("--only", help="comma-separated run names (default: all)")
    parser.add_argument("--write-machine", type=Path, help="save constants fitted on all runs")
    parser.add_argument("--json-out", type=Path, help="save the table as JSON")
    parser.add_argument(
        "--cores",
        type=float,
        default=float(len(os.sched_getaffinity(0))),
        help="cores the ranks share (default: this process's CPU affinity)",
    )
    args = parser.parse_args()
    if args.pingpong is not None:
        pingpong_rank(args.pingpong)
        return
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    chosen = set(args.only.split(",")) if args.only else {r.name for r in RUNS}
    runs = [r for r in RUNS if r.name in chosen]
    unknown = sorted(chosen - {r.name for r in RUNS})
    if unknown or len(runs) < 2:
        raise SystemExit(
            f"calibrate_sim: --only needs at least 2 known runs (each is predicted from the "
            f"others), got {len(runs)} known, unknown {unknown}; HINT: choose from "
            + ",".join(r.name for r in RUNS)
        )
    optimizer_s_per_param = measure_optimizer_s_per_param()
    latency_s, bandwidth, one_way = measure_link()
    print(
        f"optimizer: {optimizer_s_per_param * 1e9:.2f} ns (CPU) per parameter per step; link: "
        f"latency {latency_s * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s; one-way "
        + ", ".join(f"{k} B {v * 1e6:.0f} us" for k, v in one_way.items())
    )
    paths = {r.name: ensure_run(r, args.runs_dir, args.reuse) for r in runs}
    decomps = [decompose(load(paths[r.name]), r.name) for r in runs]
    print_decomposition(decomps)
    rows = []
    for i, d in enumerate(decomps):
        others = decomps[:i] + decomps[i + 1 :]
        machine = machine_from(others, optimizer_s_per_param, (latency_s, bandwidth), args.cores)
        path = paths[d.name]
        predicted = predict(path, d.algorithm, machine)
        unshared = predict(path, d.algorithm, dataclasses.replace(machine, cores=None))
        no_wake = predict(path, d.algorithm, dataclasses.replace(machine, poll_max_s=None))
        plain = predict(path, d.algorithm, None, None)
        ratio_only = predict(path, d.algorithm, None)
        per_interval = predict(path, d.algorithm, machine, "run-interval")
        # Without the run's own stage times: the median ratio of the other runs on as many ranks.
        peers = [o.wall_s_per_cpu_s for o in others if o.num_stages == d.num_stages]
        k_others = statistics.median(peers) if peers else 1.0
        blind = predict(path, d.algorithm, machine, f"{k_others:.6g}")
        rows.append(
            {
                "run": d.name,
                "stages": d.num_stages,
                "microbatches": d.num_microbatches,
                "schedule": d.schedule,
                "policy": d.algorithm,
                "measured_step_s": d.step_s,
                "predicted_step_s": predicted,
                "ratio": predicted / d.step_s,
                "uncalibrated_ratio": plain / d.step_s,
                "core_per_stage_ratio": unshared / d.step_s,
                "no_wakeup_ratio": no_wake / d.step_s,
                "wall_per_cpu_only_ratio": ratio_only / d.step_s,
                "interval_wall_per_cpu_ratio": per_interval / d.step_s,
                "others_wall_per_cpu": k_others,
                "others_wall_per_cpu_ratio": blind / d.step_s,
                "wall_s_per_cpu_s": d.wall_s_per_cpu_s,
                "overheads_fitted_on_others": machine.to_json(),
            }
        )
    print(
        f"\n{'run':<20}{'stages':>7}{'M':>4}{'sched':>7}{'measured s':>12}{'predicted s':>13}"
        f"{'ratio':>8}  |{'k':>6}{'no k':>7}{'k only':>8}{'k intv':>8}{'k other':>9}"
        f"{'unshared':>10}{'no wake':>9}"
    )
    for row in rows:
        print(
            f"{row['run']:<20}{row['stages']:>7}{row['microbatches']:>4}{row['schedule']:>7}"
            f"{row['measured_step_s']:>12.3f}{row['predicted_step_s']:>13.3f}"
            f"{row['ratio']:>8.3f}  |{row['wall_s_per_cpu_s']:>6.2f}"
            f"{row['uncalibrated_ratio']:>7.3f}{row['wall_per_cpu_only_ratio']:>8.3f}"
            f"{row['interval_wall_per_cpu_ratio']:>8.3f}{row['others_wall_per_cpu_ratio']:>9.3f}"
            f"{row['core_per_stage_ratio']:>10.3f}{row['no_wakeup_ratio']:>9.3f}"
        )
    worst = max(abs(row["ratio"] - 1) for row in rows)
    print(f"worst |ratio - 1|: {worst:.3f} over {len(rows)} runs (overheads fitted leave-one-out)")
    print(
        "after |: k = the run's median measured wall/CPU; ratios of: no k = compute only (the "
        "old model); k only = each step's k, no overheads or link; k intv = all terms, one k "
        "per report interval (--wall-per-cpu run-interval); k other = all terms, k the median "
        "of the other runs on as many ranks instead of this run's stage times; unshared = all "
        f"terms, but a core per stage instead of {args.cores:g} cores shared; no wake = all "
        "terms, but inputs noticed at once (no back-off wake-up delay)"
    )
    everything = machine_from(decomps, optimizer_s_per_param, (latency_s, bandwidth), args.cores)
    print(
        f"fitted on all runs: {everything.overheads.action_s * 1e3:.3f} ms/action, "
        f"{everything.overheads.step_s * 1e3:.2f} ms/step, "
        f"{everything.overheads.report_s * 1e3:.2f} ms/report (CPU)"
    )
    if args.write_machine is not None:
        notes = {
            **(everything.notes or {}),
            "measured": time.strftime("%Y-%m-%d %H:%M"),
            "one_way_s_by_bytes": one_way,
            "how": "benchmarks/calibrate_sim.py; docs/simulate.md#calibration",
        }
        save_machine(
            MachineModel(
                overheads=everything.overheads,
                latency_s=latency_s,
                bandwidth_bytes_per_s=bandwidth,
                cores=args.cores,
                poll_max_s=WAIT_MAX_SLEEP_S,
                notes=notes,
            ),
            args.write_machine,
        )
    write_json_out(args.json_out, rows)


if __name__ == "__main__":
    main()
