"""Dynamic block-sparse attention: dense at density 1, skipped blocks are really skipped."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dynmo_hpc.config import SparseAttentionSection
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.model.schemes.sparse_attention import (
    block_sparse_attention,
    blocks_kept_per_row,
    density_at,
    select_key_blocks,
)
from tests.helpers.scheme_jobs import scheme_config, train_one_rank


def _qkv(B=2, nh=3, T=64, hs=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=gen, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_density_one_equals_dense_attention(block_size):
    q, k, v = _qkv()
    y, kept, causal = block_sparse_attention(q, k, v, block_size, 1.0)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert kept == causal
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    for a, b in zip(
        torch.autograd.grad(y, (q, k, v), g), torch.autograd.grad(dense, (q, k, v), g), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kept_blocks_follow_the_density_and_include_the_local_block():
    assert blocks_kept_per_row(4, 0.5) == [1, 1, 2, 2]
    assert blocks_kept_per_row(4, 1.0) == [1, 2, 3, 4]
    assert blocks_kept_per_row(4, 0.01) == [1, 1, 1, 1]
    q, k, _ = _qkv()
    q_block, k_block = select_key_blocks(q, k, 8, 0.5)
    keep = blocks_kept_per_row(8, 0.5)
    assert q_block.tolist() == [i for i in range(8) for _ in range(keep[i])]
    for b in range(2):
        for h in range(3):
            start = 0
            for i in range(8):
                chosen = k_block[b, h, start : start + keep[i]].tolist()
                assert i in chosen and all(j <= i for j in chosen)  # local, causal
                start += keep[i]


def test_sparse_output_equals_dense_attention_masked_to_the_kept_blocks():
    """Skipped blocks contribute nothing; kept blocks are computed exactly."""
    q, k, v = _qkv(seed=3)
    block_size, density = 8, 0.4
    y, kept, causal = block_sparse_attention(q, k, v, block_size, density)
    assert kept == sum(blocks_kept_per_row(8, density)) < causal
    q_block, k_block = select_key_blocks(q, k, block_size, density)
    T = q.shape[2]
    allowed = torch.zeros(2, 3, T, T, dtype=torch.bool)
    for p, qb in enumerate(q_block.tolist()):
        for b in range(2):
            for h in range(3):
                kb = int(k_block[b, h, p])
                rows = slice(qb * block_size, (qb + 1) * block_size)
                cols = slice(kb * block_size, (kb + 1) * block_size)
                allowed[b, h, rows, cols] = True
    allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(y, masked, rtol=1e-5, atol=1e-6)


def test_the_choice_depends_on_the_data():
    q1, k1, _ = _qkv(seed=1)
    q2, k2, _ = _qkv(seed=2)
    assert not torch.equal(
        select_key_blocks(q1, k1, 8, 0.5)[1], select_key_blocks(q2, k2, 8, 0.5)[1]
    )


def test_density_drifts_linearly_per_layer():
    section = SparseAttentionSection(
        density=0.5, drift_factor=0.5, drift_start_step=10, drift_end_step=30
    )
    got = [density_at(section, 0.5, t) for t in (0, 10, 20, 30, 99)]
    assert got == [0.5, 0.5, 0.375, 0.25, 0.25]
    assert density_at(section, 0.8, 20) == pytest.approx(0.6)
    grow = SparseAttentionSection(density=0.8, drift_factor=2.0, drift_end_step=4)
    assert density_at(grow, 0.8, 4) == 1.0  # clamped


def test_initial_density_is_shared_and_each_layer_drifts_to_its_own():
    section = SparseAttentionSection(
        layer_density=[0.25, 0.5], initial_density=1.0, drift_start_step=10, drift_end_step=30
    )
    assert [density_at(section, 0.25, t) for t in (0, 10, 20, 30, 99)] == [
        1.0,
        1.0,
        0.625,
        0.25,
        0.25,
    ]
    assert [density_at(section, 0.5, t) for t in (0, 10, 20, 30)] == [1.0, 1.0, 0.75, 0.5]
    halved = SparseAttentionSection(initial_density=1.0, drift_factor=0.5, drift_end_step=4)
    assert density_at(halved, 0.5, 2) == pytest.approx(0.625)  # towards 0.5 * 0.5
    assert density_at(halved, 0.5, 4) == 0.25


def test_a_dense_start_sparsifies_each_layer_to_its_own_density(tmp_path):
    cfg = scheme_config(
        tmp_path,
        "sparse_attention",
        "schemes.sparse_attention.initial_density=1.0",
        "schemes.sparse_attention.drift_factor=1.0",
        "pipeline.num_stages=1",
    )
    assert [float(build_layer(cfg, i).attn.density) for i in range(1, 5)] == [1.0] * 4
    run = train_one_rank(cfg)
    reports = [e for e in run.events if e["kind"] == "scheme_stats"]
    first, last = reports[0]["layers"], reports[-1]["layers"]
    assert [last[str(i)]["attn.density"] for i in range(1, 5)] == [0.5, 1.0, 0.25, 0.75]
    # The first report's steps ran at (nearly) dense attention, the last's at the layers' own.
    assert first["3"]["attn.kept_blocks"] > last["3"]["attn.kept_blocks"]


def test_layers_get_their_own_density_and_the_controller_drifts_it(tmp_path):
    cfg = scheme_config(tmp_path, "sparse_attention", "pipeline.num_stages=1")
    densities = [float(build_layer(cfg, i).attn.density) for i in range(1, 5)]
    assert densities == [0.5, 1.0, 0.25, 0.75]
    run = train_one_rank(cfg)
    stats = [e for e in run.events if e["kind"] == "scheme_stats"][-1]["layers"]
    factor = 0.5  # drift 1 -> 0.5 over steps 0..4; after 4 steps it is complete
    assert [stats[str(i)]["attn.density"] for i in range(1, 5)] == pytest.approx(
        [d * factor for d in (0.5, 1.0, 0.25, 0.75)]
    )
    nb = 32 // 8
    for i, d in zip(range(1, 5), (0.5, 1.0, 0.25, 0.75), strict=True):
        kept, causal = stats[str(i)]["attn.kept_blocks"], stats[str(i)]["attn.causal_blocks"]
        # Two steps since the last report, 4 microbatches each; density during them was drifting.
        assert kept < causal or math.isclose(d, 1.0)
        assert causal == 2 * 4 * nb * (nb + 1) // 2
