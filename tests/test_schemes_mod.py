"""Mixture of Depths: a routed block processes exactly its configured fraction of tokens."""

from __future__ import annotations

import torch

from dynmo_hpc.config import MoDSection
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.mod import capacity_at, tokens_processed
from tests.helpers.scheme_jobs import scheme_config, train_one_rank


def _ctx() -> MicrobatchContext:
    z = torch.zeros(2, 32, dtype=torch.long)
    return MicrobatchContext(tokens=z, targets=z)


def test_tokens_processed_per_sequence():
    assert tokens_processed(128, 0.125) == 16
    assert tokens_processed(32, 0.3) == 10  # ceil(9.6)
    assert tokens_processed(32, 0.001) == 1
    assert tokens_processed(32, 1.0) == 32


def test_capacity_differs_by_block_as_configured(tmp_path):
    cfg = scheme_config(tmp_path, "mod")  # layers [1, 2, 4], capacities [0.5, 0.25, 0.75]
    blocks = {i: build_layer(cfg, i) for i in range(1, 5)}
    assert blocks[3].depth_router is None
    assert [blocks[i].depth_router.capacity for i in (1, 2, 4)] == [0.5, 0.25, 0.75]


def test_block_processes_the_configured_fraction_and_skips_the_rest(tmp_path):
    cfg = scheme_config(tmp_path, "mod")
    for index, capacity in ((1, 0.5), (2, 0.25), (4, 0.75)):
        block = build_layer(cfg, index)
        assert isinstance(block, SchemeBlock)
        shapes: dict[str, tuple[int, ...]] = {}

        def record(name: str, shapes: dict = shapes):
            return lambda mod, inp, out: shapes.__setitem__(name, tuple(inp[0].shape))

        block.attn.register_forward_hook(record("attn"))
        block.mlp.register_forward_hook(record("mlp"))
        h = torch.randn(2, 32, 32, requires_grad=True)
        out = block({"h": h}, _ctx())["h"]
        k = tokens_processed(32, capacity)
        assert shapes["attn"] == (2, k, 32) and shapes["mlp"] == (2, k, 32)
        selected = block.depth_router.last_selected  # (B, k), ascending positions
        assert selected.shape == (2, k)
        skipped = torch.ones(2, 32, dtype=torch.bool)
        skipped[torch.arange(2)[:, None], selected] = False
        assert torch.equal(out[skipped], h[skipped])  # residual path, untouched
        assert not torch.equal(out[~skipped], h[~skipped])
        # The selected tokens are the router's top-k of each sequence.
        score = block.depth_router.proj(h).squeeze(-1)
        assert torch.equal(score.topk(k, dim=1).indices.sort(dim=1).values, selected)
        assert block.depth_router.stats["processed"] == 2 * k


def test_router_learns_through_the_block_update(tmp_path):
    cfg = scheme_config(tmp_path, "mod")
    block = build_layer(cfg, 2)
    out = block({"h": torch.randn(2, 32, 32)}, _ctx())["h"]
    out.square().sum().backward()
    assert block.depth_router.proj.weight.grad is not None
    assert float(block.depth_router.proj.weight.grad.abs().sum()) > 0


def test_capacity_anneals_linearly_from_the_shared_start_to_each_blocks_own():
    section = MoDSection(initial_capacity=1.0, anneal_start_step=10, anneal_end_step=30)
    got = [capacity_at(section, 0.125, t) for t in (0, 10, 20, 30, 99)]
    assert got == [1.0, 1.0, 0.5625, 0.125, 0.125]
    assert capacity_at(section, 0.5, 20) == 0.75
    assert capacity_at(MoDSection(), 0.25, 0) == 0.25  # no annealing: the own capacity
    jump = MoDSection(initial_capacity=1.0, anneal_start_step=5, anneal_end_step=5)
    assert [capacity_at(jump, 0.25, t) for t in (5, 6)] == [1.0, 0.25]


def test_annealed_blocks_start_dense_and_reach_their_own_capacity(tmp_path):
    cfg = scheme_config(
        tmp_path,
        "mod",
        "schemes.mod.initial_capacity=1.0",
        "schemes.mod.anneal_end_step=3",
        "pipeline.num_stages=1",
    )
    block = build_layer(cfg, 2)
    assert float(block.depth_router.current_capacity) == 1.0
    assert "depth_router.current_capacity" in block.state_dict()  # checkpointed
    block({"h": torch.randn(2, 32, 32)}, _ctx())
    assert block.depth_router.last_selected.shape == (2, 32)  # dense at the start
    run = train_one_rank(cfg)
    reports = [e for e in run.events if e["kind"] == "scheme_stats"]
    first, last = reports[0]["layers"], reports[-1]["layers"]
    for i, capacity in ((1, 0.5), (2, 0.25), (4, 0.75)):
        assert last[str(i)]["depth_router.capacity"] == capacity
        seen = last[str(i)]["depth_router.tokens"]
        # Steps 2-3 ran two thirds of the way and at the own capacity: fewer tokens than 0-1.
        assert last[str(i)]["depth_router.processed"] < first[str(i)]["depth_router.processed"]
        assert last[str(i)]["depth_router.processed"] < seen
    plain = build_layer(scheme_config(tmp_path, "mod"), 2)
    assert "depth_router.current_capacity" not in plain.state_dict()  # unchanged without it
