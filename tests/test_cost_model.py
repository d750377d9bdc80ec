"""The per-layer cost model: FLOPs and bytes worked out by hand for a block, and what each
scheme's state removes. No fitted constants: these check the arithmetic, not a machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dynmo_hpc.config import ModelSection
from dynmo_hpc.sim.cost_model import (
    GROUP_OPS,
    RANK_OPS,
    LayerShape,
    PassWork,
    SchemeState,
    elementwise,
    layer_cost,
    layer_shapes,
    layer_times_s,
    matmul,
    pass_time_s,
)
from dynmo_hpc.sim.machine import LayerRates, MachineModel, load_machine, save_machine

# d_model 64, d_ff 256, 4 heads, 128 tokens, micro batch 2: N = 256 tokens.
BLOCK = LayerShape(kind="block", d_model=64, d_ff=256, num_heads=4, seq_len=128, micro_batch=2)
N = 256
QKV_PROJ = 2 * N * 64 * 64 * 4  # q, k, v and the output projection: 8 N C^2
FFN = 2 * N * 64 * 256 * 2  # c_fc and c_proj: 4 N C F
# Causal (query, key) pairs per head per sequence as the tiled kernel computes them: 4 tiles
# of 32 queries, each with every key up to its last query: 32 * (32 + 64 + 96 + 128).
PAIRS = 32 * (32 + 64 + 96 + 128)
ATTENTION = 4 * 2 * PAIRS * 64  # Q K^T and A V over all heads (64 channels), 2 sequences


def test_matmul_and_elementwise_by_hand() -> None:
    op = matmul(2, 3, 4)
    assert (op.forward_flops, op.forward_bytes) == (48, (6 + 12 + 8) * 4)
    assert (op.dgrad_flops, op.wgrad_flops) == (48, 48)
    no_weight = matmul(2, 3, 4, weight=False)
    assert (no_weight.dgrad_flops, no_weight.wgrad_flops) == (96, 0)
    act = elementwise(10)
    assert (act.forward_flops, act.forward_bytes, act.dgrad_bytes) == (0, 80, 120)


def test_plain_block_flops_by_hand() -> None:
    cost = layer_cost(BLOCK)
    assert QKV_PROJ + FFN == 2 * N * 12 * 64 * 64  # the textbook 24 N C^2 at d_ff = 4 C
    assert cost.forward_flops == QKV_PROJ + FFN + ATTENTION == 30_408_704
    # Backward: input and weight gradient per weight matmul, two products per attention one.
    assert cost.backward_flops == 2 * (QKV_PROJ + FFN) + 2 * ATTENTION == 60_817_408
    assert (cost.forward_attention_flops, cost.backward_attention_flops) == (
        ATTENTION,
        2 * ATTENTION,
    )
    assert cost.ops["mlp_fc"].forward_flops == 2 * N * 64 * 256


def test_plain_block_bytes_by_hand() -> None:
    cost = layer_cost(BLOCK)
    c, f = 64, 256
    matmuls = [(N, c, c), (N, c, 2 * c), (N, c, c), (N, c, f), (N, f, c)]
    matmul_values = sum(m * k + k * n + m * n for m, k, n in matmuls)
    elementwise_values = 4 * N * c + N * f  # ln_1, residual, ln_2, residual; GELU
    attention_values = 2 * 64 * (2 * 128 + 2 * 128)  # Q, K, V read and Y written
    expected = 4 * (matmul_values + 2 * elementwise_values + attention_values)
    assert cost.forward_bytes == expected


def test_pruning_halves_the_feed_forward_and_the_attention() -> None:
    plain = layer_cost(BLOCK)
    neurons = layer_cost(BLOCK, SchemeState(neurons_kept=0.5))
    assert neurons.forward_flops == plain.forward_flops - FFN / 2
    assert neurons.ops["mlp_proj"].forward_flops == plain.ops["mlp_proj"].forward_flops / 2
    heads = layer_cost(BLOCK, SchemeState(heads_kept=0.5))
    assert heads.forward_flops == plain.forward_flops - (QKV_PROJ + ATTENTION) / 2
    assert heads.backward_flops == plain.backward_flops - (QKV_PROJ + ATTENTION)


def test_frozen_drops_the_weight_gradient_and_the_prefix_the_whole_backward() -> None:
    plain = layer_cost(BLOCK)
    frozen = layer_cost(BLOCK, SchemeState(frozen=True))
    assert frozen.forward_flops == plain.forward_flops
    assert frozen.backward_flops == QKV_PROJ + FFN + 2 * ATTENTION
    assert 0 < frozen.backward_bytes < plain.backward_bytes
    prefix = layer_cost(BLOCK, SchemeState(frozen=True, frozen_prefix=True))
    assert (prefix.backward_flops, prefix.backward_bytes) == (0, 0)
    assert prefix.forward_bytes == plain.forward_bytes


def test_mod_keeps_tokens_and_attends_among_them() -> None:
    mod = layer_cost(BLOCK, SchemeState(tokens_kept=0.5))
    # 64 kept tokens: 2 tiles of 32 queries, 32 * (32 + 64) pairs per sequence.
    assert mod.forward_flops == (QKV_PROJ + FFN) / 2 + 4 * 2 * (32 * 96) * 64


def test_early_exit_still_projects_every_token_s_keys_and_values() -> None:
    state = SchemeState(tokens_kept=0.25, kv_tokens_kept=1.0)
    cost = layer_cost(BLOCK, state)
    kv = 2 * N * 64 * 128
    rest = QKV_PROJ - kv + FFN
    assert cost.ops["kv"].forward_flops == kv
    # The masked kernel computes every (active query, key) pair: 32 x 128 per sequence.
    assert cost.forward_flops == kv + rest / 4 + 4 * 2 * (32 * 128) * 64
    with_exit = layer_cost(BLOCK, SchemeState(tokens_kept=0.25, kv_tokens_kept=1.0, exit_head=True))
    assert with_exit.forward_flops - cost.forward_flops == 2 * (N / 4) * 64 * 256


def test_sparse_attention_computes_whole_kept_blocks() -> None:
    # 128 tokens in 16-token blocks: 8 query blocks, 36 causal key blocks; density 0.25 keeps 9
    # of them, each a whole 16 x 16 block of pairs (the diagonal one too, masked).
    sparse = layer_cost(BLOCK, SchemeState(attention_density=0.25))
    kept_pairs = 9 * 16 * 16
    assert sparse.forward_flops == QKV_PROJ + FFN + 4 * 2 * kept_pairs * 64
    scores = 2 * 4 * kept_pairs * 4  # 2 sequences, 4 heads, float32
    assert sparse.ops["attention"].forward_bytes == 6 * scores
    assert sparse.ops["attention_gather"].forward_indexed_bytes == 2 * 2 * 9 * 16 * 64 * 16
    # ceil(0.25 (i + 1)) over the 8 query blocks: 1,1,1,1,2,2,2,2: two groups, two loops
    assert sparse.ops["attention"].count == 2 * GROUP_OPS
    dense = layer_cost(BLOCK)
    # The ranking (forward only) and the gather come on top; the groups replace one fused op.
    assert sparse.forward_ops == dense.forward_ops + RANK_OPS + 1 + 2 * GROUP_OPS - 1
    assert sparse.backward_ops == dense.backward_ops + 1 + 2 * GROUP_OPS - 1
    smaller = layer_cost(BLOCK, SchemeState(attention_density=0.25, sparse_block_size=8))
    assert smaller.forward_flops < sparse.forward_flops


def test_moe_follows_the_expert_loads() -> None:
    router = 2 * N * 64 * 2
    balanced = layer_cost(BLOCK, SchemeState(expert_loads=(0.5, 0.5)))
    skewed = layer_cost(BLOCK, SchemeState(expert_loads=(0.75, 0.25)))
    padded = layer_cost(BLOCK, SchemeState(expert_loads=(0.75, 0.25), padded=True))
    assert balanced.forward_flops == QKV_PROJ + ATTENTION + FFN + router
    assert skewed.forward_flops == balanced.forward_flops  # gathered: the same tokens in all
    assert padded.forward_flops == QKV_PROJ + ATTENTION + 1.5 * FFN + router
    top2 = layer_cost(BLOCK, SchemeState(expert_loads=(0.5, 0.5, 0.5, 0.5)))
    assert top2.forward_flops == QKV_PROJ + ATTENTION + 2 * FFN + 2 * N * 64 * 4


def test_embedding_and_head_by_hand() -> None:
    common = {"d_model": 64, "seq_len": 128, "micro_batch": 2}
    embedding = layer_cost(LayerShape(kind="embedding", **common))
    assert embedding.forward_flops == embedding.backward_flops == 0
    # Forward: token rows gathered (read, written), position rows gathered (read, written),
    # their sum (both read, the sum written).
    assert embedding.forward_bytes == 4 * ((N + N) * 64 + (128 + 128) * 64 + (N + 128 + N) * 64)
    # Backward: both tables' gradients zeroed (256 + 128 rows), the output's gradient read
    # twice (token rows, the batch sum), 128 position rows written and added.
    assert embedding.backward_bytes == 4 * (2 * N * 64 + 256 * 64 + 3 * 128 * 64)
    head = layer_cost(LayerShape(kind="head", vocab_size=256, **common))
    assert head.forward_flops == 2 * N * 64 * 256
    assert head.backward_flops == 2 * head.forward_flops
    active = layer_cost(LayerShape(kind="head", **common), SchemeState(tokens_kept=0.5))
    assert active.forward_flops == head.forward_flops / 2


def test_times_from_the_rates() -> None:
    rates = LayerRates(flops_per_s=1e9, bytes_per_s=1e8, overhead_s=1e-4)
    assert pass_time_s(PassWork(flops=2e9, nbytes=1e8), rates) == pytest.approx(3.0001)
    cost = layer_cost(BLOCK, SchemeState(frozen=True, frozen_prefix=True))
    forward_s, backward_s = layer_times_s(cost, rates)
    assert forward_s == pytest.approx(cost.forward_flops / 1e9 + cost.forward_bytes / 1e8 + 1e-4)
    assert backward_s == 0.0


def test_attention_flops_at_their_own_rate() -> None:
    rates = LayerRates(flops_per_s=1e9, bytes_per_s=1e8, attention_flops_per_s=2.5e8)
    work = PassWork(flops=2e9, attention_flops=5e8)
    assert pass_time_s(work, rates) == pytest.approx(1.5 + 2.0)
    unset = LayerRates(flops_per_s=1e9, bytes_per_s=1e8)  # None: the matmul rate
    assert pass_time_s(work, unset) == pytest.approx(2.0)
    cost = layer_cost(BLOCK)
    forward_s, _ = layer_times_s(cost, rates)
    matmul_s = (cost.forward_flops - ATTENTION) / 1e9
    assert forward_s == pytest.approx(matmul_s + ATTENTION / 2.5e8 + cost.forward_bytes / 1e8)


def test_early_exit_moves_whole_rows_without_element_indices() -> None:
    # h[b, t] and index_put take one index per row of 64 values: streaming copies, plain
    # bytes; MoD's torch.gather takes one per element: indexed bytes.
    early = layer_cost(BLOCK, SchemeState(tokens_kept=0.5, kv_tokens_kept=1.0))
    assert early.forward_indexed_bytes == early.backward_indexed_bytes == 0
    assert early.ops["select"].forward_bytes == 2 * (2 * (N / 2) * 64) * 4
    mod = layer_cost(BLOCK, SchemeState(tokens_kept=0.5))
    assert mod.forward_indexed_bytes > 0


def test_layer_shapes_of_a_model() -> None:
    model = ModelSection(num_blocks=3, d_model=64, num_heads=4, d_ff=256, layer_d_ff=[8, 16, 32])
    shapes = layer_shapes(model, micro_batch=2)
    assert [s.kind for s in shapes] == ["embedding", "block", "block", "block", "head"]
    assert [s.d_ff for s in shapes[1:-1]] == [8, 16, 32]
    assert all(s.micro_batch == 2 and s.seq_len == 128 for s in shapes)


@pytest.mark.parametrize(
    ("shape", "state", "match"),
    [
        (BLOCK, SchemeState(neurons_kept=0.0), r"neurons_kept=0.0 must be in \(0, 1\]"),
        (BLOCK, SchemeState(tokens_kept=1.5), r"tokens_kept=1.5 must be in"),
        (BLOCK, SchemeState(frozen_prefix=True), "frozen_prefix=True needs frozen=True"),
        (BLOCK, SchemeState(expert_loads=()), "expert_loads is empty"),
        (BLOCK, SchemeState(expert_loads=(0.5, -1.0)), "expert load -1.0 must be"),
        (
            LayerShape(kind="block", d_model=64, d_ff=0, seq_len=8, micro_batch=1),
            SchemeState(),
            "d_ff=0 must be an integer >= 1",
        ),
        (
            LayerShape(kind="block", d_model=64, d_ff=8, num_heads=3, seq_len=8, micro_batch=1),
            SchemeState(),
            "num_heads=3 must divide d_model=64",
        ),
    ],
)
def test_bad_shapes_and_states_are_refused(
    shape: LayerShape, state: SchemeState, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        layer_cost(shape, state)


def test_machine_file_carries_the_rates(tmp_path: Path) -> None:
    model = MachineModel(layer_rates=LayerRates(flops_per_s=2e10, bytes_per_s=5e9, overhead_s=3e-5))
    save_machine(model, tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["layer_flops_per_s"] == 2e10
    assert load_machine(tmp_path / "m.json") == model
    (tmp_path / "plain.json").write_text('{"step_overhead_s": 1}')
    assert load_machine(tmp_path / "plain.json").layer_rates is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"layer_flops_per_s": 1e9}', "but not layer_bytes_per_s, layer_overhead_s; HINT"),
        (
            '{"layer_flops_per_s": 0, "layer_bytes_per_s": 1, "layer_overhead_s": 0}',
            "layer_flops_per_s=0.0 must be > 0",
        ),
        (
            '{"layer_flops_per_s": 1, "layer_bytes_per_s": 1, "layer_overhead_s": -1}',
            "layer_overhead_s=-1.0 must be >= 0",
        ),
    ],
)
def test_bad_rates_in_a_machine_file(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_machine(tmp_path / "m.json")


def test_mod_routes_every_token_and_moves_the_kept_ones_by_index() -> None:
    mod = layer_cost(BLOCK, SchemeState(tokens_kept=0.5))
    kept = N // 2 * 64  # values of the kept tokens
    assert mod.ops["select"].forward_indexed_bytes == kept * 16  # value read, written, int64 index
    assert mod.ops["scatter"].forward_bytes == 2 * N * 64 * 4  # the out-of-place copy of h
    assert mod.forward_indexed_bytes == 2 * kept * 16
    assert mod.forward_ops == layer_cost(BLOCK).forward_ops + 5 + 1  # routing ops, top-k twice
    exit_state = SchemeState(tokens_kept=0.5, kv_tokens_kept=1.0)
    early = layer_cost(BLOCK, exit_state)
    assert "router" not in early.ops and early.ops["pack_queries"].count == 4
    assert early.backward_ops < early.forward_ops  # packing and masks run forward only
    assert layer_cost(BLOCK).forward_indexed_bytes == 0


def test_optional_rates_round_trip_and_are_checked(tmp_path: Path) -> None:
    rates = LayerRates(
        flops_per_s=2e10,
        bytes_per_s=5e9,
        overhead_s=3e-5,
        backward_flops_per_s=1e10,
        indexed_bytes_per_s=1e9,
        op_overhead_s=2e-5,
    )
    save_machine(MachineModel(layer_rates=rates), tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["layer_backward_flops_per_s"] == 1e10 and data["layer_op_overhead_s"] == 2e-5
    assert load_machine(tmp_path / "m.json").layer_rates == rates
    cost = layer_cost(BLOCK, SchemeState(tokens_kept=0.5))
    forward_s, backward_s = layer_times_s(cost, rates)
    assert forward_s == pytest.approx(
        cost.forward_flops / 2e10
        + cost.forward_bytes / 5e9
        + cost.forward_indexed_bytes / 1e9
        + cost.forward_ops * 2e-5
        + 3e-5
    )
    assert backward_s == pytest.approx(
        cost.backward_flops / 1e10
        + cost.backward_bytes / 5e9
        + cost.backward_indexed_bytes / 1e9
        + cost.backward_ops * 2e-5
        + 3e-5
    )
    (tmp_path / "bad.json").write_text('{"layer_op_overhead_s": 1e-5}')
    with pytest.raises(ValueError, match="gives layer_op_overhead_s but not layer_flops_per_s"):
        load_machine(tmp_path / "bad.json")
    data["layer_indexed_bytes_per_s"] = 0
    (tmp_path / "zero.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"layer_indexed_bytes_per_s=0.0 must be > 0"):
        load_machine(tmp_path / "zero.json")


def test_a_linear_with_a_bias_sums_its_output_gradient() -> None:
    fc = layer_cost(BLOCK).ops["mlp_fc"]
    assert fc.wgrad_bytes == fc.forward_bytes + (N * 256 + 256) * 4  # dY read again, db written
    assert fc.dgrad_bytes == fc.forward_bytes
    head = LayerShape(kind="head", d_model=64, seq_len=128, micro_batch=2)
    lm_head = layer_cost(head).ops["lm_head"]  # bias=False in the model
    assert lm_head.wgrad_bytes == lm_head.forward_bytes


def test_op_kinds_and_weight_bytes_at_their_own_rates(tmp_path: Path) -> None:
    """Each op kind is charged its own overhead (the default one where unset), weights and the
    their own bytes rate; the machine file carries all four."""
    cost = layer_cost(BLOCK, SchemeState(tokens_kept=0.5))
    assert cost.forward_ops_by_kind == {"other": 7, "matmul": 5, "index": 5}
    assert sum(cost.forward_ops_by_kind.values()) == cost.forward_ops
    weights = (64 * 64 + 64 * 128 + 64 * 64 + 2 * 64 * 256) * 4
    assert cost.forward_weight_bytes == weights
    assert cost.backward_weight_bytes == 2 * weights  # read for dX, dW written
    frozen = layer_cost(BLOCK, SchemeState(frozen=True))
    assert frozen.backward_weight_bytes == weights
    embedding = layer_cost(replace(BLOCK, kind="embedding", d_ff=0))
    assert embedding.forward_ops_by_kind == {"lookup": 3}
    assert embedding.forward_weight_bytes == (256 + 128) * 64 * 4  # both tables
    assert embedding.backward_weight_bytes == 2 * embedding.forward_weight_bytes
    base = LayerRates(flops_per_s=1e9, bytes_per_s=1e8, op_overhead_s=1e-5)
    rates = replace(
        base,
        matmul_op_overhead_s=3e-5,
        index_op_overhead_s=0.0,
        lookup_op_overhead_s=7e-5,
        weight_bytes_per_s=2e8,
    )
    extra_s = 5 * 2e-5 - 5 * 1e-5 + weights / 2e8  # matmul ops dearer, index ops free
    assert layer_times_s(cost, rates)[0] == pytest.approx(layer_times_s(cost, base)[0] + extra_s)
    extra_embedding_s = 3 * 6e-5 + embedding.forward_weight_bytes / 2e8
    assert layer_times_s(embedding, rates)[0] == pytest.approx(
        layer_times_s(embedding, base)[0] + extra_embedding_s
    )
    save_machine(MachineModel(layer_rates=rates), tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json").layer_rates == rates
    data = json.loads((tmp_path / "m.json").read_text())
    data["layer_weight_bytes_per_s"] = 0
    (tmp_path / "zero.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"layer_weight_bytes_per_s=0.0 must be > 0"):
        load_machine(tmp_path / "zero.json")
