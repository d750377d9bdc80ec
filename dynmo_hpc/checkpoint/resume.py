"""What a checkpoint holds for a run, and how every rank saves and restores it (collectively).

The invariant this module exists for: a run stopped after step k and resumed, on the same or a
different number of stages, produces per-step losses bitwise equal to a run never stopped. That
holds because everything the math depends on is either in the checkpoint or a pure function of
``(config, step)``:

- per global layer: weights, AdamW state (moments, step count) and every scheme's state, which
  lives in the layer's state dict (pruned shapes, routers, frozen flags, densities, exit heads);
- the step count, which fixes the data position (batches are a pure function of
  ``(seed, step, microbatch)``, :mod:`dynmo_hpc.data.batches`) and the LR schedule position;
- the random streams: weights are initialised from ``(seed, layer)`` and batches from
  ``(seed, step, microbatch)``; training draws from no stateful generator, so the seed is the
  whole RNG state and is part of the run's identity;
- the frozen prefix, re-derived from the layers' frozen flags.

The balancer's state (smoothed costs, report count, bandwidth) and the loss history are saved
too, so the resumed run decides from the same history and its result covers every step. Costs
are measurements and never repeat exactly, so later balancing decisions may differ; the losses
do not, because migration is invisible to the math.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance import partition, uniform
from dynmo_hpc.balance.registry import INITIAL_ALGORITHM, STATIC
from dynmo_hpc.checkpoint import store
from dynmo_hpc.checkpoint.lineage import Key
from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.resume_rules import (
    KeyRule,
    ResumeVerdict,
    check_allowed_keys,
    classify,
    judge_resume,
    refusal_message,
)
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.optim import apply_hyperparameters
from dynmo_hpc.model.schemes import restore_layer
from dynmo_hpc.pipeline.stage import LayerSlot, PipelineStage

log = logging.getLogger(__name__)


def config_dict(cfg: JobConfig) -> dict[str, Any]:
    """The whole config flattened to dotted keys, as JSON gives it back (saved in every run
    state, so a resume can name each key that changed)."""
    flat = store.flatten("", cfg.to_dict())
    normalised: dict[str, Any] = json.loads(json.dumps(flat))
    return normalised


def identity(cfg: JobConfig) -> dict[str, Any]:
    """The keys that make a checkpoint's layers and data meaningful (:attr:`KeyRule.IDENTITY`:
    ``job.seed``, ``model.*``, ``schemes.*``, ``data.*``), flattened."""
    return {k: v for k, v in config_dict(cfg).items() if classify(k) is KeyRule.IDENTITY}


def config_sha256(cfg: JobConfig) -> str:
    return hashlib.sha256(cfg.to_yaml().encode()).hexdigest()


def saved_config(cfg: JobConfig, state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's flattened config. A checkpoint written before the whole config was
    saved holds only its identity keys: the job's values stand in for the rest (so only
    identity keys and ``train.steps`` below the checkpoint's step can be refused for it)."""
    saved = state.get("config")
    if isinstance(saved, dict):
        return saved
    return {**config_dict(cfg), **state.get("identity", {})}


def judge(
    cfg: JobConfig, state: dict[str, Any], allowed: Collection[str] | None = None
) -> ResumeVerdict:
    """The resume rules (:mod:`dynmo_hpc.config.resume_rules`) applied to ``cfg`` and a run
    state; ``allowed=None`` accepts every MATH change (the ranks: the launcher judged those)."""
    current = config_dict(cfg)
    return judge_resume(
        saved_config(cfg, state),
        current,
        int(state["step"]),
        set(current) if allowed is None else allowed,
    )


def check_compatible(
    cfg: JobConfig, state: dict[str, Any], where: Path, allowed: Collection[str] = ()
) -> ResumeVerdict:
    """Refuse a checkpoint the job may not continue from (the resume rules, with ``allowed``
    the ``--allow-change`` keys), and a run whose run log the resumed run could not append to;
    returns the verdict (its ``accepted`` and ``passed`` changes, for the launcher to print).

    Called by the launcher before any rank starts (``dynmo-hpc run --resume``, ``sbatch
    --submit --resume``, ``submit --resume``), so a refused change or a damaged ``run.h5`` is
    reported there, in one line, instead of by rank 0 after the ranks started.
    """
    problem = check_allowed_keys(allowed, config_dict(cfg))
    if problem is not None:
        raise CheckpointError(problem)
    verdict = check_identity(cfg, state, where, allowed)
    check_run_log(cfg.run_dir / "run.h5")
    return verdict


@dataclass(frozen=True)
class ChosenCheckpoint:
    """The checkpoint ``--resume [PATH]`` resolved to, judged against the job."""

    path: Path
    step: int
    state: dict[str, Any]
    verdict: ResumeVerdict
    skipped: list[store.Candidate]
    """Newer checkpoints passed over (damaged or incomplete), each with its problem."""


def choose_checkpoint(
    cfg: JobConfig, path_text: str, allowed: Collection[str] = ()
) -> ChosenCheckpoint:
    """Resolve ``--resume [PATH]`` (empty: the job's run directory) to a verified checkpoint
    and check it under the resume rules; the launcher's side, before any rank starts.

    Raises:
        CheckpointError: nothing intact to resume from, or a change the rules refuse.
    """
    chosen, skipped = store.resolve(Path(path_text) if path_text else cfg.run_dir)
    state = store.read_run_state(chosen.path)
    verdict = check_compatible(cfg, state, chosen.path, allowed)
    return ChosenCheckpoint(chosen.path, chosen.step, state, verdict, list(skipped))


def check_run_log(path: Path) -> None:
    """Refuse a run log that a resumed run could not append to (damaged, foreign, unreadable).

    Reads it fully in a forked child (:func:`dynmo_hpc.runlog.load`), so never call it on an
    MPI rank; rank 0's writer does the cheap superblock check itself. No file: nothing to check,
    the resumed run starts a new run log.
    """
    if not path.is_file():
        return
    from dynmo_hpc.errors import RunLogError
    from dynmo_hpc.runlog.reader import load

    try:
        load(path)
    except RunLogError as exc:
        reason = str(exc).split("; HINT:")[0]
        raise RunLogError(
            f"cannot resume: the run log the resumed run appends to is unusable ({reason}); "
            f"HINT: move {path} aside (the resumed run then starts a new run "
            "log) or restore it from a backup"
        ) from None


def check_identity(
    cfg: JobConfig, state: dict[str, Any], where: Path, allowed: Collection[str] | None = None
) -> ResumeVerdict:
    """Refuse a checkpoint whose model, schemes, data or seed differ from the job's, one whose
    step is past ``train.steps``, and (with ``allowed`` given) a MATH change not allowed."""
    if state["parts"][-1] != cfg.model.num_layers:
        raise CheckpointError(
            f"checkpoint {where} holds {state['parts'][-1]} layers, the job has "
            f"{cfg.model.num_layers}; HINT: resume with the job file that wrote it"
        )
    verdict = judge(cfg, state, allowed)
    message = refusal_message(verdict, str(where), int(state["step"]))
    if message is not None:
        raise CheckpointError(message)
    return verdict


def resume_partition(cfg: JobConfig, state: dict[str, Any]) -> list[int]:
    """The partition to resume on.

    ``pipeline.partition`` if the job gives one; the saved partition if the stage count is
    unchanged; otherwise the optimal partition of the saved smoothed costs for the new stage
    count (uniform when no costs were measured yet, or the job balances statically).
    """
    num_stages = cfg.pipeline.num_stages
    if cfg.pipeline.partition is not None:
        return list(cfg.pipeline.partition)
    saved = [int(b) for b in state["parts"]]
    if len(saved) - 1 == num_stages:
        return saved
    costs = state.get("balancer", {}).get("costs_s")
    if costs and cfg.balance.algorithm not in (STATIC, INITIAL_ALGORITHM):
        return partition(costs, num_stages, "optimal")
    return uniform([1.0] * cfg.model.num_layers, num_stages)


def restored_costs(cfg: JobConfig, state: dict[str, Any]) -> list[float] | None:
    """The saved smoothed per-layer costs, in this job's scale (None when none were saved).

    A cost is seconds per step of one replica, which runs ``train.num_microbatches /
    pipeline.replicas`` microbatches; after a change of either (a pack that dropped replicas,
    an accepted change of the batch) the saved costs are scaled by the ratio of microbatches
    per replica now to then, so the first decisions after the resume price the gain of a
    rebalance at the step they will run (not at 1/2 of it after 2 -> 1 replicas).

    Example: costs [1.0, 2.0] saved with 2 replicas of 4 microbatches resume on 1 replica as
    [2.0, 4.0]."""
    costs = (state.get("balancer") or {}).get("costs_s")
    if not costs:
        return None
    saved_replicas = int(state.get("num_replicas") or 1)
    saved_train = (state.get("config") or {}).get("train") or {}
    saved_microbatches = int(saved_train.get("num_microbatches") or cfg.train.num_microbatches)
    now = cfg.train.num_microbatches / cfg.pipeline.replicas
    scale = now / (saved_microbatches / saved_replicas)
    return [float(c) * scale for c in costs]


@dataclass(frozen=True)
class Restored:
    """What a rank learned from the checkpoint it resumed from."""

    directory: Path
    step: int
    """Completed steps: training continues with this step index."""
    state: dict[str, Any]
    restore_s: float
    """Slowest rank's seconds to read and rebuild its layers."""


def restore_layers(
    pipeline_stage: PipelineStage, directory: Path, comm: MPI.Comm, t0: float
) -> float:
    """Rebuild this rank's layers from ``directory`` (weights, AdamW, scheme state, counters).

    ``pipeline_stage`` must have been built without layers. Each layer file is read once and
    checked against its manifest entry (size, CRC-32) on the bytes loaded. Returns the slowest
    rank's restore time in seconds, counted from ``t0``. A rank that fails raises; under
    ``python -m mpi4py`` that aborts the job with its message.
    """
    stage = pipeline_stage
    cfg = stage.cfg
    slots: list[LayerSlot] = []
    files = store.manifest_files(directory)
    for index in range(stage.parts[stage.stage], stage.parts[stage.stage + 1]):
        expected = files.get(store.layer_name(index))
        if expected is None:
            raise CheckpointError(
                f"checkpoint {directory}: its manifest lists no {store.layer_name(index)}; "
                "HINT: resume from an earlier checkpoint"
            )
        payload = store.load_layer(directory, index, expected)
        try:
            module = restore_layer(cfg, index, payload["module"])
            store.restore_counters(module, payload.get("counters", {}))
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{directory / store.layer_name(index)}: the saved layer does not fit the "
                f"model ({type(exc).__name__}: {str(exc)[:200]}); HINT: resume from an earlier "
                "checkpoint"
            ) from None
        slot = stage.make_slot(index, module)
        try:
            slot.optimizer.load_state_dict(payload["optimizer"])
            # The saved param_groups carry the old betas / weight decay: the job's apply.
            apply_hyperparameters(slot.optimizer, cfg.train)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{directory / store.layer_name(index)}: optimizer state does not fit the "
                f"layer ({exc}); HINT: resume from a checkpoint written by this version"
            ) from None
        slots.append(slot)
    stage.replace_layers(stage.parts, arrived=slots, leaving=set())
    return float(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))


def save(
    comm: MPI.Comm,
    run_dir: Path,
    step: int,
    pipeline_stage: PipelineStage,
    keep: int,
    run_state: dict[str, Any] | None,
    after_files: Callable[[], None] | None = None,
    parent: Key | None = None,
    *,
    writes_layers: bool = True,
) -> tuple[Path, float, int]:
    """Write checkpoint ``step`` collectively; returns (its path, seconds, bytes written).

    Every rank with ``writes_layers`` writes its own layers (with data-parallel replicas only
    replica 0's ranks do: each layer once, since the replicas hold identical copies); rank 0
    (which passes ``run_state``; the others pass None) then writes the run state and the
    manifest, last, so the checkpoint is complete only once every file is.

    A directory of the same step already there is kept when it is a complete checkpoint that
    verifies (every file's CRC-32): nothing is written, and ``latest`` is pointed at it. That
    happens when a launch starts at the step of its newest checkpoint and saves it again (a
    restart after a failure that came after the final checkpoint, ``--resume`` of a finished
    run, a requeue of one); removing it before writing its replacement would lose the newest
    checkpoint (with ``checkpoint.keep: 1`` the only one) to a kill or a full disk in between.
    Keeping it loses nothing: a top-level checkpoint is of the current lineage (a resume from
    an older one moves the newer ones under ``abandoned/``), and a step's weights, optimizer
    state and data position are a pure function of the run's history up to that step (the
    module docstring's invariant), so it holds what the ranks would write. Only an
    incomplete or damaged directory (a replay after a crash mid-save) is removed and rewritten:
    it holds nothing to lose.
    ``after_files`` runs once this rank's layer files are written (fault injection).
    ``parent`` (rank 0): the checkpoint this launch resumed from or wrote last, for the lineage
    record (:mod:`.lineage`).
    """
    t0 = time.perf_counter()
    root = store.checkpoint_root(run_dir)
    directory = store.step_dir(root, step)
    keep_existing = False
    if comm.rank == 0 and directory.exists():
        problem = store.verify(directory)
        keep_existing = problem is None
        if keep_existing:
            log.info("checkpoint %s is complete and intact: kept, not written again", directory)
            atomic_write_text(root / store.LATEST, directory.name + "\n")
        else:
            log.warning("replacing the unusable checkpoint %s (%s)", directory, problem)
            shutil.rmtree(directory)
    if comm.bcast(keep_existing, root=0):
        seconds = float(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return directory, seconds, 0
    comm.Barrier()
    files: dict[str, dict[str, int]] = {}
    for slot in pipeline_stage.slots if writes_layers else []:
        data = store.layer_bytes(slot.index, slot.module, slot.optimizer)
        files[store.layer_name(slot.index)] = store.write_file(
            directory, store.layer_name(slot.index), data
        )
    if after_files is not None:
        after_files()
    gathered = comm.gather(files, root=0)
    if comm.rank == 0:
        assert run_state is not None, "rank 0 writes the run state"
        merged = {name: entry for part in gathered for name, entry in part.items()}
        merged[store.RUN_STATE] = store.write_run_state(directory, run_state)
        store.commit(root, step, merged, keep, parent)
        num_bytes = sum(entry["bytes"] for entry in merged.values())
    else:
        num_bytes = 0
    seconds = float(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return directory, seconds, int(comm.bcast(num_bytes, root=0))


def checked_resume_dir(cfg: JobConfig, path: Path) -> tuple[Path, dict[str, Any]]:
    """Check ``path`` (a ``step_<n>`` directory) and its fit to ``cfg``; returns it and its
    run state. Used by rank 0, so a checkpoint damaged after the launcher chose it is still
    refused with a clear error: the cheap check (manifest, file sizes) and the run state's
    CRC-32 here; each layer file's CRC-32 as its rank loads it (:func:`restore_layers`), so no
    file is read twice on the ranks."""
    problem = store.verify(path, only=(store.RUN_STATE,))
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be resumed from: {problem}")
    state = store.read_run_state(path)
    check_identity(cfg, state, path)  # the run log was checked by the launcher (no fork here)
    return path, state
