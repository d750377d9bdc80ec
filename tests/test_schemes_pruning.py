"""Gradual structured pruning: the schedule is followed, matrices shrink, state survives."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dynmo_hpc.config import PruningSection
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.model.gpt import MLP, MicrobatchContext
from dynmo_hpc.model.optim import build_optimizer
from dynmo_hpc.model.schemes import build_layer, restore_layer
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.pruning import (
    HEAD,
    NEURON,
    Candidate,
    apply_removals,
    choose_removals,
    initial_counts,
    layer_sparsity,
    sparsity_at,
)
from tests.helpers.scheme_jobs import scheme_config, train_one_rank


def test_cubic_schedule_of_zhu_and_gupta():
    section = PruningSection(
        initial_sparsity=0.0, final_sparsity=0.8, start_step=0, end_step=40, interval_steps=10
    )
    got = [sparsity_at(section, t) for t in range(0, 50, 10)]
    want = [0.8 + (0.0 - 0.8) * (1 - t / 40) ** 3 for t in range(0, 50, 10)]
    assert got == pytest.approx(want)
    assert got == pytest.approx([0.0, 0.4625, 0.7, 0.7875, 0.8])
    assert sparsity_at(section, 5) is None and sparsity_at(section, 50) is None
    late = PruningSection(initial_sparsity=0.1, final_sparsity=0.5, start_step=7, end_step=7)
    assert sparsity_at(late, 6) is None and sparsity_at(late, 7) == 0.5


def test_global_ranking_removes_the_smallest_across_layers():
    cands = [
        Candidate(0.1, 1, "mlp", 0, NEURON),
        Candidate(0.2, 2, "mlp", 0, NEURON),
        Candidate(0.3, 1, "mlp", 1, NEURON),
        Candidate(5.0, 2, "mlp", 1, NEURON),
        Candidate(0.05, 1, "attn", 0, HEAD),
        Candidate(0.5, 2, "attn", 0, HEAD),
    ]
    out = choose_removals(cands, {NEURON: 4, HEAD: 2}, 0.5, {NEURON: 1, HEAD: 1})
    assert out == {(1, "mlp"): [0], (2, "mlp"): [0]}  # heads: min 1 per layer blocks removal
    # min_keep caps removals: with one neuron left per layer the 75% target is not reached.
    out = choose_removals(cands, {NEURON: 4, HEAD: 2}, 0.75, {NEURON: 1, HEAD: 1})
    assert out == {(1, "mlp"): [0], (2, "mlp"): [0]}
    # Already removed structures count towards the target (4 initial, 3 remain: 1 gone).
    out = choose_removals(cands[1:4], {NEURON: 4}, 0.5, {NEURON: 1, HEAD: 1})
    assert out == {(2, "mlp"): [0]}
    # A frozen layer's structures count as present but are never removed.
    locked = [Candidate(c.score, c.layer, c.group, c.index, c.kind, c.layer == 1) for c in cands]
    out = choose_removals(locked, {NEURON: 4, HEAD: 2}, 0.5, {NEURON: 1, HEAD: 1})
    assert out == {(2, "mlp"): [0]}


def _ctx(B: int = 2, T: int = 32) -> MicrobatchContext:
    z = torch.zeros(B, T, dtype=torch.long)
    return MicrobatchContext(tokens=z, targets=z)


class _Slot:
    def __init__(self, index, module, cfg):
        self.index, self.module = index, module
        self.optimizer = build_optimizer(module, cfg.train)


def test_shrunk_block_computes_what_the_masked_dense_block_computes(tmp_path):
    """Removing neurons/heads physically equals zeroing them in the dense block."""
    cfg = scheme_config(tmp_path, "pruning")
    block = build_layer(cfg, 2)
    assert isinstance(block, SchemeBlock)
    dense = copy.deepcopy(block)
    slot = _Slot(2, block, cfg)
    drop_neurons, drop_heads = [0, 5, 17, 63], [1]
    apply_removals(slot, {"mlp": drop_neurons, "attn": drop_heads}, cfg.schemes.pruning, cfg)
    assert block.mlp.c_fc.weight.shape == (60, 32) and block.mlp.c_proj.weight.shape == (32, 60)
    assert block.attn.num_heads == 1
    assert block.attn.c_attn.weight.shape == (48, 32) and block.attn.c_proj.weight.shape == (32, 16)
    with torch.no_grad():  # the dense equivalent: zero what was removed
        dense.mlp.c_fc.weight[drop_neurons] = 0
        dense.mlp.c_fc.bias[drop_neurons] = 0
        hs = dense.attn.head_size
        dense.attn.c_proj.weight[:, hs : 2 * hs] = 0
    h = torch.randn(2, 32, 32)
    torch.testing.assert_close(block({"h": h}, _ctx())["h"], dense({"h": h}, _ctx())["h"])
    assert layer_sparsity(block, cfg, 2) == {HEAD: 0.5, NEURON: 4 / 64}


def test_optimizer_keeps_the_surviving_rows_state(tmp_path):
    cfg = scheme_config(tmp_path, "pruning")
    block = build_layer(cfg, 1)
    slot = _Slot(1, block, cfg)
    for _ in range(2):
        block({"h": torch.randn(2, 32, 32)}, _ctx())["h"].square().mean().backward()
        slot.optimizer.step()
        slot.optimizer.zero_grad()
    old_state = slot.optimizer.state[block.mlp.c_fc.weight]
    old_avg = old_state["exp_avg"].clone()
    apply_removals(slot, {"mlp": [1, 2]}, cfg.schemes.pruning, cfg)
    new_state = slot.optimizer.state[block.mlp.c_fc.weight]
    keep = [i for i in range(64) if i not in (1, 2)]
    assert torch.equal(new_state["exp_avg"], old_avg[keep])
    assert float(new_state["step"]) == 2.0
    assert len(slot.optimizer.state) == len(list(block.parameters()))
    # It keeps training: a step with the new optimizer runs and changes the shrunk weights.
    before = block.mlp.c_fc.weight.detach().clone()
    block({"h": torch.randn(2, 32, 32)}, _ctx())["h"].square().mean().backward()
    slot.optimizer.step()
    assert not torch.equal(before, block.mlp.c_fc.weight)


SHORT_SCHEDULE = [
    "schemes.pruning.end_step=4",
    "schemes.pruning.interval_steps=2",
    "schemes.pruning.final_sparsity=0.6",
    "train.steps=5",
    "pipeline.num_stages=1",
]
"""Pruning events after steps 0, 2 and 4 to 60 %, on one stage."""


def test_sparsity_follows_the_schedule_and_differs_by_layer(tmp_path):
    cfg = scheme_config(tmp_path, "pruning", *SHORT_SCHEDULE)
    section = cfg.schemes.pruning
    initial = initial_counts(cfg)
    assert initial == {NEURON: 4 * 64, HEAD: 4 * 2}
    run = train_one_rank(cfg)
    prunes = [e for e in run.events if e["kind"] == "prune"]
    assert [e["step"] for e in prunes] == [0, 2, 4]
    for event in prunes:
        target = sparsity_at(section, event["step"])
        assert event["target_sparsity"] == pytest.approx(target)
        want = math.floor(target * initial[NEURON] + 1e-9) / initial[NEURON]
        assert event["sparsity"][NEURON] == pytest.approx(want)
    # Globally ranked: the final 60% is spread unevenly over the four blocks.
    slots = run.slots
    per_layer = [layer_sparsity(slots[i].module, cfg, i)[NEURON] for i in range(1, 5)]
    assert sum(per_layer) / 4 == pytest.approx(math.floor(0.6 * 256) / 256)
    assert len({round(s, 6) for s in per_layer}) > 1, per_layer
    # The matrices really shrank (the parameter count fell).
    widths = [slots[i].module.mlp.c_fc.out_features for i in range(1, 5)]
    assert sum(widths) == 256 - math.floor(0.6 * 256)


def test_layer_scope_prunes_every_block_to_the_target_by_its_own_ranking(tmp_path):
    """``scope: layer``: each block reaches the sparsity alone, whatever the other blocks hold."""
    cfg = scheme_config(tmp_path, "pruning", "schemes.pruning.scope=layer", *SHORT_SCHEDULE)
    run = train_one_rank(cfg)
    per_layer_width = math.floor(0.6 * 64 + 1e-9)
    widths = [run.slots[i].module.mlp.c_fc.out_features for i in range(1, 5)]
    assert widths == [64 - per_layer_width] * 4
    final = [e for e in run.events if e["kind"] == "prune"][-1]
    assert final["sparsity"][NEURON] == pytest.approx(per_layer_width / 64)
    # Against the global ranking of the same weights: the blocks end at different widths there.
    glob = scheme_config(tmp_path / "g", "pruning", *SHORT_SCHEDULE)
    glob_slots = train_one_rank(glob).slots
    glob_widths = [glob_slots[i].module.mlp.c_fc.out_features for i in range(1, 5)]
    assert len(set(glob_widths)) > 1, glob_widths
    assert sum(glob_widths) == 256 - math.floor(0.6 * 256)


def test_an_unknown_pruning_scope_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"schemes.pruning.scope='model': choose one of global"):
        scheme_config(tmp_path, "pruning", "schemes.pruning.scope=model")


def test_pruned_layer_restores_from_its_state_dict(tmp_path):
    cfg = scheme_config(tmp_path, "pruning")
    block = build_layer(cfg, 3)
    apply_removals(
        _Slot(3, block, cfg), {"mlp": list(range(10)), "attn": [0]}, cfg.schemes.pruning, cfg
    )
    restored = restore_layer(cfg, 3, block.state_dict())
    h = torch.randn(2, 32, 32)
    assert torch.equal(block({"h": h}, _ctx())["h"], restored({"h": h}, _ctx())["h"])
    assert isinstance(restored.mlp, MLP) and restored.attn.num_heads == 1
