"""Every scheme's state crosses a real migration bit for bit, inside a real multi-rank run.

Three ranks run the library's own trainer (``Trainer.train``) twice per case: once static, once
with ``balance.force_moves=true``, which makes each load report (every step) migrate a layer
with :func:`dynmo_hpc.pipeline.migration.move.migrate` (pickled module and AdamW, verified chunks).
A migrated layer must arrive exactly as it left, so the two runs must agree bitwise: per-step
losses, the run log's scheme events (counters, densities, capacities, freezes, prunes), every
rank's frozen prefix, and every layer's state after every step (so right after each migration,
before the next forward can overwrite anything): parameters and buffers (pruned shapes, masks,
frozen flags, densities, capacities, exit-head switches), ``requires_grad``, the class and public
attributes of every submodule (router statistics, head counts, ...), and the AdamW state. The
static run's losses and final weights also equal the single-process reference
(:func:`dynmo_hpc.testing.reference.train_reference`) bitwise.

The initial partition is chosen so the migrated layers carry the scheme's state: the forced
moves shift a boundary by one layer at a time, so with 3 stages only two layers ever move
(layers 2 and 4 from ``[0, 2, 4, 6]``); freezing starts from ``[0, 1, 3, 6]`` so that layer 1
moves after it froze. The schemes' counters are reported and reset at each load report, just
before its migration, so they travel empty; the compared events show that they carry on. One
``mpiexec`` launch runs every case (rank start-up costs seconds).

Run as a rank program by the test (``python -m mpi4py tests/test_migration_schemes.py OUT``).
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.schemes import BUILTIN_SCHEMES
from dynmo_hpc.runlog import load
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import ROOT, TINY
from tests.helpers.scheme_jobs import (
    LLAMA,
    SCHEME_OVERRIDES,
    arch_schemes,
    scheme_acted,
    scheme_events,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

NUM_RANKS = 3
NUM_STEPS = 5
"""Reports after steps 0..4; every one but the last migrates one layer (4 migrations)."""

SCHEMES = [scheme.name for scheme in BUILTIN_SCHEMES]
"""Every built-in scheme, from the registry."""

COMBINATIONS = [
    ("moe", "pruning"),
    ("pruning", "sparse_attention"),
    ("moe", "early_exit"),
    ("freezing", "mod"),
    ("freezing", "early_exit"),
    ("freezing", "pruning"),
]

PADDED_MOE: dict[str, tuple[list[str], list[str]]] = {
    "moe_padded": (["moe"], ["schemes.moe.dispatch=padded"]),
    "moe_padded_pruned": (
        ["moe", "pruning"],
        ["schemes.moe.dispatch=padded", *SCHEME_OVERRIDES["pruning"]],
    ),
}
"""The padded MoE dispatch, batched, and expert by expert once pruning left the experts at
different widths: name -> (its schemes, its overrides besides MoE's)."""


def _cases() -> dict[str, tuple[list[str], list[str]]]:
    """Case name -> (the schemes it switches on, its overrides on the TINY job)."""
    cases = {scheme: ([scheme], SCHEME_OVERRIDES[scheme]) for scheme in SCHEMES}
    for combo in COMBINATIONS:
        overrides = [o for scheme in combo for o in SCHEME_OVERRIDES[scheme]]
        cases["+".join(combo)] = (list(combo), overrides)
    for name, (schemes, extra) in PADDED_MOE.items():
        cases[name] = (schemes, [*SCHEME_OVERRIDES["moe"], *extra])
    for scheme in arch_schemes("llama"):  # the llama family's scheme blocks
        cases[f"llama_{scheme}"] = ([scheme], [*LLAMA, *SCHEME_OVERRIDES[scheme]])
    return cases


CASES = _cases()


def initial_parts(case: str) -> list[int]:
    """Freezing freezes layer i after step i + 1: from this partition the forced moves carry
    frozen layer 1 (after step 2); otherwise they carry blocks 2 and 4."""
    return [0, 1, 3, 6] if "freezing" in case else [0, 2, 4, 6]


def case_config(out_dir: Path, case: str, mode: str) -> config_mod.JobConfig:
    """``mode``: "static" (no layer moves) or "moving" (a forced migration at every report)."""
    balance = (
        ["balance.algorithm=optimal", "balance.force_moves=true"]
        if mode == "moving"
        else ["balance.algorithm=static"]
    )
    parts = ",".join(str(p) for p in initial_parts(case))
    return config_mod.load(
        ROOT / "jobs/default.yaml",
        [
            *TINY,
            *CASES[case][1],
            f"job.out_dir={out_dir}",
            f"job.name={case}_{mode}",
            f"pipeline.num_stages={NUM_RANKS}",
            f"pipeline.partition=[{parts}]",
            f"train.steps={NUM_STEPS}",
            "balance.interval=1",
            *balance,
        ],
    )


# --------------------------------------------------------------------------------------------
# The rank program
# --------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A picklable copy of an attribute value (tensors detached and cloned)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def layer_snapshot(slot: Any) -> dict[str, Any]:
    """Everything a layer carries: state dict, trainability, every submodule's class and
    public attributes, and its optimizer's class and state dict."""
    module = slot.module
    return {
        "state": _plain(module.state_dict()),
        "requires_grad": {name: p.requires_grad for name, p in module.named_parameters()},
        "grad_is_none": {name: p.grad is None for name, p in module.named_parameters()},
        "modules": {
            path: (
                type(sub).__qualname__,
                {k: _plain(v) for k, v in vars(sub).items() if not k.startswith("_")},
            )
            for path, sub in module.named_modules()
        },
        "optimizer": (type(slot.optimizer).__qualname__, _plain(slot.optimizer.state_dict())),
    }


def fingerprint(value: Any, path: str = "") -> dict[str, str]:
    """``value`` flattened to path -> its exact bits: a digest of a tensor's dtype, shape and
    bytes, a function's qualified name (its repr holds a per-process address), the repr of anything
    else (exact for floats), the type and length of a container."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).numpy().tobytes()
        header = f"{value.dtype}{tuple(value.shape)}".encode()
        return {path: hashlib.sha256(header + data).hexdigest()[:20]}
    if isinstance(value, dict):
        items = [(f"{path}.{key}", v) for key, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif callable(value) and hasattr(value, "__qualname__"):  # a function's repr has its address
        return {path: f"callable:{value.__module__}.{value.__qualname__}"}
    else:
        return {path: f"{type(value).__name__}:{value!r}"}
    out = {path: f"{type(value).__name__} of {len(value)}"}
    for key, item in items:
        out.update(fingerprint(item, key))
    return out


def rank_main(out_dir: Path) -> None:
    from mpi4py import MPI

    from dynmo_hpc.train.trainer import Trainer

    class ObservedTrainer(Trainer):
        """The real trainer; after every step (and its migration, if any) rank 0 collects the
        fingerprint of every layer and every rank's no-gradient prefix (``no_grad_below``)."""

        fingerprints: list[dict[str, Any]]

        def step(self, step: int) -> Any:
            stats = super().step(step)
            stage = self.pipeline_stage
            mine = {slot.index: fingerprint(layer_snapshot(slot)) for slot in stage.slots}
            gathered = self.comm.gather((mine, stage.no_grad_below), root=0)
            if gathered is not None:
                layers = {i: f for g, _ in gathered for i, f in g.items()}
                self.fingerprints.append(
                    {"layers": dict(sorted(layers.items())), "frozen": [p for _, p in gathered]}
                )
            return stats

    comm = MPI.COMM_WORLD
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        for mode in ("static", "moving"):
            cfg = case_config(out_dir, case, mode)
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            trainer = ObservedTrainer(cfg, comm, cfg.run_dir)
            trainer.fingerprints = []
            result = trainer.train()
            stage = trainer.pipeline_stage
            mine = {slot.index: layer_snapshot(slot) for slot in stage.slots}
            gathered = comm.gather(mine, root=0)
            if gathered is not None:
                layers = {i: snap for g in gathered for i, snap in g.items()}
                results.setdefault(case, {})[mode] = {
                    "losses": list(result.losses),
                    "parts": list(result.parts),
                    "layers": dict(sorted(layers.items())),
                    "per_step": trainer.fingerprints,
                }
    if comm.rank == 0:
        torch.save(results, out_dir / "results.pt")


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``mpiexec`` launch of the rank program for every case."""
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    out_dir = tmp_path_factory.mktemp("migration_schemes")
    rank_argv = [sys.executable, "-m", "mpi4py", __file__, str(out_dir)]
    cmd = LocalMpiLauncher().command(LaunchSpec(NUM_RANKS, rank_argv))
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_dir, torch.load(out_dir / "results.pt", weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` hold the same values bit for bit (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{where}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        )
        same = (
            a.contiguous().reshape(-1).numpy().tobytes()
            == b.contiguous().reshape(-1).numpy().tobytes()
        )
        assert same, f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {b!r}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: nan vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def moved_layers(out_dir: Path, case: str) -> dict[int, list[int]]:
    """Per migration (by the step it followed): the layers it moved, from the run log."""
    log = load(out_dir / f"{case}_moving" / "run.h5")

    def owners(parts: list[int]) -> list[int]:
        return [s for s in range(NUM_RANKS) for _ in range(parts[s], parts[s + 1])]

    moved: dict[int, list[int]] = {}
    for step in log.report_steps()[1:]:
        pairs = zip(owners(log.parts_at(step - 1)), owners(log.parts_at(step)), strict=True)
        moved[step - 1] = [layer for layer, (a, b) in enumerate(pairs) if a != b]
    return moved


def check_case(out_dir: Path, results: dict[str, Any], case: str) -> None:
    """The moving run equals the static run bitwise, both equal the reference, schemes acted."""
    static, moving = results[case]["static"], results[case]["moving"]
    moves = moved_layers(out_dir, case)
    assert list(moves) == list(range(NUM_STEPS - 1)), moves  # a migration after every step
    carriers = {1, 3} if "freezing" in case else {2, 4}  # see initial_parts
    assert all(len(m) == 1 for m in moves.values()) and {m[0] for m in moves.values()} == carriers

    assert len(static["losses"]) == NUM_STEPS and moving["losses"] == static["losses"]
    events = {
        mode: scheme_events(load(out_dir / f"{case}_{mode}" / "run.h5").events)
        for mode in ("static", "moving")
    }
    assert_bitwise_equal(events["moving"], events["static"], f"{case} scheme events")
    assert list(moving["layers"]) == list(static["layers"]) == list(range(6))
    assert len(moving["per_step"]) == len(static["per_step"]) == NUM_STEPS
    for step, (got, want) in enumerate(zip(moving["per_step"], static["per_step"], strict=True)):
        assert got["frozen"] == want["frozen"], f"{case} after step {step}: frozen prefix"
        for index, prints in want["layers"].items():
            moved = got["layers"][index]
            differ = [
                (path, prints.get(path), moved.get(path))
                for path in sorted(prints.keys() | moved.keys())
                if prints.get(path) != moved.get(path)
            ]
            assert not differ, (
                f"{case} after step {step}, layer {index} (static, moving): {differ[:4]}"
            )
    for index, snapshot in static["layers"].items():
        assert_bitwise_equal(moving["layers"][index], snapshot, f"{case} layer {index}")
    for scheme in CASES[case][0]:
        assert scheme_acted(scheme, events["moving"]), f"{scheme} did not act in case {case}"

    reference = train_reference(case_config(out_dir / "reference", case, "static"))
    assert static["losses"] == reference.losses  # bitwise
    for index, state in reference.state.items():
        assert_bitwise_equal(static["layers"][index]["state"], state, f"{case} reference {index}")


CARRIES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "moe": lambda layer: "mlp.router" in layer["modules"],
    "pruning": lambda layer: layer["modules"]["mlp.c_fc"][1]["out_features"] < 64,
    "freezing": lambda layer: bool(layer["state"]["frozen"]),
    "sparse_attention": lambda layer: "attn.density" in layer["state"],
    "early_exit": lambda layer: "exit_head.enabled" in layer["state"],
    "mod": lambda layer: "depth_router.proj.weight" in layer["state"],
}
"""Whether a layer's final snapshot holds the scheme's state (d_ff is 64 in the TINY model)."""


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_state_survives_real_migration(runs, scheme):
    out_dir, results = runs
    check_case(out_dir, results, scheme)
    carrier = 1 if scheme == "freezing" else 2  # moved at report 2, after step 2
    assert moved_layers(out_dir, scheme)[2] == [carrier]
    assert CARRIES[scheme](results[scheme]["moving"]["layers"][carrier])


def test_frozen_layer_migrates_frozen(runs):
    """The forced moves carry layer 1 after it froze; it arrives frozen and stays frozen."""
    out_dir, results = runs
    events = scheme_events(load(out_dir / "freezing_moving" / "run.h5").events)
    # A report (every step) comes after the step's freeze decision, a migration after the report.
    prefix_end = {e["step"]: e["frozen_prefix_end"] for e in events if e["kind"] == "scheme_stats"}
    moves = moved_layers(out_dir, "freezing")
    assert moves[2] == [1] and prefix_end[2] == 2, (moves, prefix_end)
    layer = results["freezing"]["moving"]["layers"][1]
    assert not any(layer["requires_grad"].values()) and all(layer["grad_is_none"].values())


LLAMA_CARRIES: dict[str, Callable[[dict[str, Any]], bool]] = {
    **CARRIES,
    "pruning": lambda layer: layer["modules"]["mlp.up_proj"][1]["out_features"] < 64,
    "sparse_attention": lambda layer: "self_attn.density" in layer["state"],
}
"""CARRIES for llama blocks (their attention and SwiGLU have Hugging Face's names)."""


@pytest.mark.parametrize("scheme", arch_schemes("llama"))
def test_llama_scheme_state_survives_real_migration(runs, scheme):
    """The llama family's scheme blocks cross real migrations bit for bit too."""
    out_dir, results = runs
    case = f"llama_{scheme}"
    check_case(out_dir, results, case)
    carrier = 1 if scheme == "freezing" else 2
    assert moved_layers(out_dir, case)[2] == [carrier]
    assert LLAMA_CARRIES[scheme](results[case]["moving"]["layers"][carrier])


@pytest.mark.parametrize("combo", COMBINATIONS, ids=["+".join(c) for c in COMBINATIONS])
def test_combined_schemes_survive_real_migration(runs, combo):
    check_case(*runs, "+".join(combo))


@pytest.mark.parametrize("case", list(PADDED_MOE))
def test_padded_moe_survives_real_migration(runs, case):
    check_case(*runs, case)
    out_dir, _ = runs
    events = scheme_events(load(out_dir / f"{case}_moving" / "run.h5").events)
    last = [e for e in events if e["kind"] == "scheme_stats"][-1]["layers"]
    for i in range(1, 5):
        assert last[str(i)]["mlp.expert_rows"] >= last[str(i)]["mlp.assignments"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
