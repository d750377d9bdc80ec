"""Layer freezing: front first, frozen weights stop changing, their backward work stops."""

from __future__ import annotations

import math

import torch

from dynmo_hpc.config import FreezingSection
from dynmo_hpc.model.optim import build_optimizer
from dynmo_hpc.model.schemes import SchemeController, build_layer, restore_layer
from dynmo_hpc.model.schemes.freezing import (
    freeze_,
    grad_norm_estimate,
    is_frozen,
    max_prefix_end,
    next_prefix_end,
)
from tests.helpers.scheme_jobs import scheme_config, train_one_rank


def test_prefix_grows_front_first_over_converged_layers_only():
    assert next_prefix_end(1, {1: True, 2: True, 3: False}, 5, 9) == 3
    assert next_prefix_end(0, {0: False, 1: True}, 5, 9) == 0  # layer 1 waits for layer 0
    assert next_prefix_end(0, {0: True, 1: True, 2: True}, 2, 9) == 2  # max per check
    assert next_prefix_end(0, {i: True for i in range(10)}, 20, 9) == 9  # the head stays
    assert max_prefix_end(FreezingSection(), 6) == 5
    assert max_prefix_end(FreezingSection(max_frozen_layers=2), 6) == 2


def test_gradient_norm_estimate_is_the_gradient_norm_after_one_step():
    """AdamW's bias-corrected first moment after one step is the gradient itself."""
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(lin.parameters(), betas=(0.9, 0.95))
    assert math.isnan(grad_norm_estimate(opt))
    lin(torch.randn(16, 8)).square().sum().backward()
    grad_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in lin.parameters()))
    opt.step()
    assert math.isclose(grad_norm_estimate(opt), grad_norm, rel_tol=1e-5)


def test_frozen_layers_stop_changing_and_their_backward_stops(tmp_path):
    one_rank = ["pipeline.num_stages=1", "balance.interval=1"]  # a layer report every step
    cfg = scheme_config(tmp_path, "freezing", "train.steps=5", *one_rank)
    run = train_one_rank(cfg)
    freezes = [e for e in run.events if e["kind"] == "freeze" and e["newly_frozen"]]
    assert [e["frozen_prefix_end"] for e in freezes] == [1, 2, 3, 4]  # one layer per check
    slots = run.slots
    for index in range(4):
        assert is_frozen(slots[index].module)
        assert all(not p.requires_grad and p.grad is None for p in slots[index].module.parameters())
    for index in (4, 5):
        assert not is_frozen(slots[index].module)
    # After layer i froze (at step s), its backward cost is exactly zero: it never ran.
    for event in freezes:
        for index in range(event["frozen_prefix_end"]):
            for step in range(event["step"] + 1, cfg.train.steps):
                assert run.backward_s[step][index] == 0.0, (index, step)
    assert run.backward_s[-1][5] > 0.0  # the head still trains

    # Weights stop changing: one more run, two steps longer, leaves the frozen layers as they were.
    longer = train_one_rank(
        scheme_config(tmp_path, "freezing", "train.steps=7", "job.name=longer", *one_rank)
    )
    slots_longer = longer.slots
    for index in range(4):
        for (name, a), b in zip(
            slots[index].module.state_dict().items(),
            slots_longer[index].module.state_dict().values(),
            strict=True,
        ):
            if name != "frozen_ref_grad_norm":
                assert torch.equal(a, b), (index, name)
    changed = [
        not torch.equal(a, b)
        for a, b in zip(
            slots[5].module.parameters(), slots_longer[5].module.parameters(), strict=True
        )
    ]
    assert any(changed)


def test_optimizer_skips_frozen_parameters(tmp_path):
    cfg = scheme_config(tmp_path, "freezing")
    block = build_layer(cfg, 2)
    opt = build_optimizer(block, cfg.train)
    freeze_(block)
    before = [p.detach().clone() for p in block.parameters()]
    opt.step()  # weight decay would move the weights if AdamW visited them
    assert all(torch.equal(a, b) for a, b in zip(before, block.parameters(), strict=True))
    assert not opt.state


def test_frozen_flag_travels_with_the_state_dict(tmp_path):
    cfg = scheme_config(tmp_path, "freezing")
    block = build_layer(cfg, 1)
    freeze_(block)
    restored = restore_layer(cfg, 1, block.state_dict())
    assert is_frozen(restored) and not any(p.requires_grad for p in restored.parameters())

    class Slot:
        def __init__(self, index, module):
            self.index, self.module = index, module

    controller = SchemeController(cfg)
    controller.resume(
        [Slot(0, restored), Slot(1, restored), Slot(2, build_layer(cfg, 2))], lambda o: [o]
    )
    assert controller.no_grad_below == 2
    assert controller.run_state()["frozen_prefix_end"] == 2
