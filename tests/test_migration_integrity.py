"""A corrupted buffer during migration is detected and fails the migration cleanly.

Two real ranks: rank 0 migrates a layer to rank 1, and on rank 1 one byte of one received chunk
is flipped before it is verified (what a bit flip on the wire or in a receive buffer looks like).
Both ranks must raise the same :class:`MigrationError` naming the layer and the chunk, within
seconds (no hang), and keep their old layers and partition; a retry then moves the layer intact.
The MPI tag budget of a migration is checked against ``MPI_TAG_UB`` before anything is sent.

Run as a rank program by the test (``python -m mpi4py tests/test_migration_integrity.py OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _state_digest(slot) -> str:
    """SHA-256 over every parameter, buffer and AdamW state tensor of a layer slot."""
    import hashlib

    h = hashlib.sha256()
    tensors = sorted(slot.module.state_dict().items())
    for pid, entry in sorted(slot.optimizer.state_dict()["state"].items()):
        tensors += [(f"{pid}.{key}", value) for key, value in sorted(entry.items())]
    for name, tensor in tensors:
        h.update(name.encode() + tensor.detach().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def rank_main(out_dir: Path) -> None:
    import torch
    from mpi4py import MPI

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.data.batches import TextDataset
    from dynmo_hpc.pipeline.comm import StageLink
    from dynmo_hpc.pipeline.migration.move import MigrationError, migrate
    from dynmo_hpc.pipeline.stage import PipelineStage

    comm = MPI.COMM_WORLD
    cfg = config_mod.from_dict(
        {
            "model": {"num_blocks": 2, "d_model": 128, "num_heads": 4, "d_ff": 512},
            "pipeline": {"num_stages": 2, "partition": [0, 2, 4]},
            "runtime": {"device": "cpu"},
        }
    )
    cpu = torch.device("cpu")
    stage = PipelineStage(
        cfg,
        comm.rank,
        [0, 2, 4],
        StageLink(comm, comm.rank, 2, cpu),
        TextDataset.from_config(cfg.data, cfg.model.seq_len),
        cpu,
    )
    for slot in stage.slots:
        for p in slot.module.parameters():
            p.grad = torch.randn_like(p)
        slot.optimizer.step()
    before = {s.index: _state_digest(s) for s in stage.slots}
    flipped = []

    def flip_one_byte(item, chunk, view):
        if comm.rank == 1 and chunk == 2 and not flipped:
            view[123] ^= 0x10
            flipped.append(chunk)

    result: dict = {"rank": comm.rank}
    try:
        migrate(stage, comm, [0, 1, 4], chunk_bytes=64 << 10, on_chunk=flip_one_byte)
        result["first"] = "succeeded"
    except MigrationError as exc:
        result["first"] = "MigrationError"
        result["message"] = str(exc)
    result["parts_after_failure"] = stage.parts
    result["layers_after_failure"] = stage.layer_indices
    result["unchanged"] = {s.index: _state_digest(s) == before[s.index] for s in stage.slots}
    migrate(stage, comm, [0, 1, 4], chunk_bytes=64 << 10)  # the retry, without the fault
    result["layers_after_retry"] = stage.layer_indices
    digests = comm.allgather({s.index: _state_digest(s) for s in stage.slots})
    sent = comm.bcast(before.get(1), root=0)
    result["moved_layer_intact"] = digests[1][1] == sent
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(result))


@pytest.mark.mpi
def test_corrupted_chunk_fails_the_migration_cleanly(tmp_path):
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    launcher = LocalMpiLauncher()
    cmd = launcher.command(LaunchSpec(2, [sys.executable, "-m", "mpi4py", __file__, str(tmp_path)]))
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["first"] == "MigrationError", r
        assert "layer 1 from rank 0 to 1" in r["message"] and "digest mismatch" in r["message"]
        assert "HINT:" in r["message"] and "first bad chunk" in r["message"]
        assert r["parts_after_failure"] == [0, 2, 4]
        assert all(r["unchanged"].values()), r  # nothing was modified by the failed attempt
        assert r["moved_layer_intact"]
    assert results[0]["message"] == results[1]["message"]  # one collective verdict
    assert results[0]["layers_after_failure"] == [0, 1] and results[1]["layers_after_failure"] == [
        2,
        3,
    ]
    assert results[0]["layers_after_retry"] == [0] and results[1]["layers_after_retry"] == [1, 2, 3]


def test_tag_budget_is_checked_against_the_mpi_limit():
    from mpi4py import MPI

    from dynmo_hpc.pipeline.migration.wire import MIN_TAG_UB, check_tag_space, tag_upper_bound

    tag_ub = tag_upper_bound(MPI.COMM_WORLD)
    assert tag_ub >= MIN_TAG_UB == 32767
    assert tag_ub == MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    check_tag_space(2 * 1000 + 1, tag_ub, "a migration of 1000 layers")  # fits
    with pytest.raises(ValueError, match=r"MPI_TAG_UB is 32767.*HINT"):
        check_tag_space(2 * 20000 + 1, 32767, "a migration of 20000 layers")


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
