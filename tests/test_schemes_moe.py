"""Mixture of Experts: routing spreads tokens, respects capacity, cost follows the routes."""

from __future__ import annotations

import pytest
import torch

from dynmo_hpc.config import MoESection
from dynmo_hpc.model.gpt import MLP, MicrobatchContext
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.model.schemes.moe import MoEFeedForward, expert_capacity, plan_routing
from tests.helpers.scheme_jobs import scheme_config


def _moe(**kwargs) -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(16, 32, MoESection(**kwargs))
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    return moe


def test_capacity_formula():
    assert expert_capacity(64, 4, 2, 1.0) == 32
    assert expert_capacity(64, 4, 2, 1.25) == 40
    assert expert_capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(1, 8, 1, 0.1) == 1


def test_plan_routing_drop_and_reroute_exact():
    ranked = torch.tensor([[0, 1, 2, 3]] * 4)
    assert plan_routing(ranked, 1, 2, "drop").tolist() == [[0], [0], [-1], [-1]]
    assert plan_routing(ranked, 1, 2, "reroute").tolist() == [[0], [0], [1], [1]]
    # First choices are served before any second choice (GShard priority).
    ranked = torch.tensor([[1, 0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    assert plan_routing(ranked, 2, 2, "drop").tolist() == [[1, -1], [0, 1], [0, -1]]
    assert plan_routing(ranked, 2, 2, "reroute").tolist() == [[1, 2], [0, 1], [0, 2]]


def test_plan_routing_properties_on_random_rankings():
    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        num_tokens, num_experts = 40 + trial, 2 + trial % 7
        top_k = 1 + trial % min(3, num_experts)
        ranked = torch.stack(
            [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
        )
        capacity = 1 + trial % 9
        for overflow in ("drop", "reroute"):
            plan = plan_routing(ranked, top_k, capacity, overflow)
            served = plan[plan >= 0]
            load = torch.bincount(served, minlength=num_experts)
            assert int(load.max()) <= capacity
            for row in plan.tolist():  # a token never uses one expert twice
                used = [e for e in row if e >= 0]
                assert len(used) == len(set(used))
            if overflow == "drop":  # drop keeps exactly the top-k choices that fit
                kept = plan >= 0
                assert torch.equal(plan[kept], ranked[:, :top_k][kept])
            else:  # reroute drops only when every expert is full
                dropped = int((plan < 0).sum())
                assert dropped == 0 or int(load.min()) == capacity or top_k == num_experts


def test_routing_spreads_tokens_and_respects_capacity():
    moe = _moe(num_experts=4, top_k=2, capacity_factor=1.0)
    x = torch.randn(256, 16)
    _, aux = moe(x)
    capacity = expert_capacity(256, 4, 2, 1.0)
    counts = moe.last_tokens_per_expert
    assert all(0 < c <= capacity for c in counts), counts
    assert max(counts) - min(counts) < capacity  # every expert gets a real share
    assert sum(counts) == 256 * 2 - moe.stats["dropped"]
    assert float(aux.detach()) > 0


def test_a_skewed_router_fills_one_expert_to_capacity_then_drops_or_reroutes():
    x = torch.randn(64, 16)
    for overflow in ("drop", "reroute"):
        moe = _moe(num_experts=4, top_k=1, capacity_factor=1.0, overflow=overflow)
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[0, 0] = 100.0  # expert 0 wins for tokens with x[:, 0] > 0 ...
        x_pos = x.clone()
        x_pos[:, 0] = x_pos[:, 0].abs() + 0.1  # ... which is every token here
        y, _ = moe(x_pos)
        counts = moe.last_tokens_per_expert
        assert counts[0] == expert_capacity(64, 4, 1, 1.0) == 16
        if overflow == "drop":
            assert sum(counts) == 16 and moe.stats["dropped"] == 48
            assert torch.equal(y[16:], torch.zeros_like(y[16:]))  # dropped: no expert output
        else:
            assert sum(counts) == 64 and moe.stats["rerouted"] == 48


def test_experts_compute_only_their_routed_tokens():
    """The cost follows the routes: expert e's MLP runs on exactly its routed rows."""
    moe = _moe(num_experts=4, top_k=2, capacity_factor=0.75)
    rows: dict[int, int] = {}
    for e, expert in enumerate(moe.experts):
        expert.c_fc.register_forward_hook(
            lambda mod, inp, out, e=e: rows.__setitem__(e, inp[0].shape[0])
        )
    moe(torch.randn(128, 16))
    assert [rows.get(e, 0) for e in range(4)] == moe.last_tokens_per_expert
    assert sum(moe.last_tokens_per_expert) < 128 * 2  # capacity 0.75 drops some work


@pytest.mark.parametrize("unequal_widths", [False, True])
def test_padded_dispatch_computes_the_busiest_load_on_every_expert_with_the_same_result(
    unequal_widths,
):
    """Padded: every expert runs on the busiest expert's row count, batched when the experts
    have one shape, one by one when pruning left them at different widths; outputs and gradients
    are those of the gathered dispatch, so only the work (and the measured cost) changes."""
    x = torch.randn(96, 16)
    results = {}
    for dispatch in ("gather", "padded"):
        moe = _moe(num_experts=4, top_k=2, capacity_factor=2.0, dispatch=dispatch)
        with torch.no_grad():
            moe.router.weight[1] += 0.5  # uneven load: expert 1 gets more than its share
        if unequal_widths:
            torch.manual_seed(5)
            moe.experts[0] = MLP(16, 24)  # as if pruned from 32 to 24 neurons
        rows: dict[int, int] = {}
        for e, expert in enumerate(moe.experts):
            expert.c_fc.register_forward_hook(
                lambda mod, inp, out, e=e, rows=rows: rows.__setitem__(e, inp[0].shape[0])
            )
        xg = x.clone().requires_grad_(True)
        y, _ = moe(xg)
        y.square().sum().backward()
        counts = moe.last_tokens_per_expert
        assert len(set(counts)) > 1  # the load really is uneven
        if dispatch == "padded":
            assert moe.last_rows_per_expert == max(counts)
            assert moe.stats["expert_rows"] == 4 * max(counts)
            if unequal_widths:  # one expert at a time, each on max(counts) rows
                assert [rows[e] for e in range(4)] == [max(counts)] * 4
            else:  # one batched (E, rows, C) computation; the experts' modules are not called
                assert rows == {}
        else:
            assert [rows.get(e, 0) for e in range(4)] == counts
            assert moe.stats["expert_rows"] == sum(counts)
        grads = [p.grad.clone() for p in moe.experts.parameters()]
        results[dispatch] = (counts, y.detach(), xg.grad, grads)
    (c_g, y_g, dx_g, w_g), (c_p, y_p, dx_p, w_p) = results["gather"], results["padded"]
    assert c_g == c_p
    torch.testing.assert_close(y_p, y_g)
    torch.testing.assert_close(dx_p, dx_g)
    for a, b in zip(w_p, w_g, strict=True):
        torch.testing.assert_close(a, b)


def test_padded_dispatch_cost_follows_the_expert_imbalance():
    """The more uneven the load, the more rows a padded block computes (same tokens)."""
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 1.0  # a constant feature: its router weight is a per-expert bias
    computed = []
    for skew in (0.0, 1.0, 3.0):
        moe = _moe(num_experts=4, top_k=1, capacity_factor=4.0, dispatch="padded")
        with torch.no_grad():
            moe.router.weight[0, 0] += skew  # pushes tokens towards expert 0
        moe(x)
        computed.append(moe.stats["expert_rows"])
        assert sum(moe.last_tokens_per_expert) == 128  # nothing dropped at this capacity
    assert computed[0] < computed[1] < computed[2] <= 4 * 128


def test_balancing_loss_evens_out_a_skewed_router():
    moe = _moe(num_experts=4, top_k=1, capacity_factor=4.0)
    with torch.no_grad():
        moe.router.weight[0] += 1.0  # skewed towards expert 0
    x = torch.randn(512, 16) + 0.5
    opt = torch.optim.SGD(moe.router.parameters(), lr=1.0)
    moe(x)
    before = max(moe.last_tokens_per_expert)
    for _ in range(60):
        _, aux = moe(x)
        opt.zero_grad()
        (aux / moe.aux_loss_weight).backward()
        opt.step()
    moe(x)
    assert max(moe.last_tokens_per_expert) < 0.8 * before


def test_moe_block_reports_its_balancing_loss(tmp_path):
    cfg = scheme_config(tmp_path, "moe")
    block = build_layer(cfg, 1)
    assert isinstance(block.mlp, MoEFeedForward)
    ctx = MicrobatchContext(
        tokens=torch.zeros(2, 32, dtype=torch.long), targets=torch.zeros(2, 32, dtype=torch.long)
    )
    out = block({"h": torch.randn(2, 32, 32)}, ctx)
    assert out["h"].shape == (2, 32, 32)
    assert len(ctx.aux_losses) == 1 and ctx.aux_losses[0].requires_grad
