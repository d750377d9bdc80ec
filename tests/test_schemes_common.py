"""Checks shared by all schemes: plain-model equivalence, rank-independent init, config errors.

The multi-rank checks are elsewhere: losses against the single-process reference in
``test_schemes_parity.py``, scheme state through real migration (each scheme alone, in
combination, and the padded MoE dispatch) in ``test_migration_schemes.py``."""

from __future__ import annotations

import re

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.gpt import Block
from dynmo_hpc.model.gpt import build_layer as base_build_layer
from dynmo_hpc.model.schemes import BUILTIN_SCHEMES, SchemeController, activation_spec, build_layer
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from tests.helpers.scheme_jobs import scheme_config

# --------------------------------------------------------------------------------------------
# Tests shared by all schemes
# --------------------------------------------------------------------------------------------

BUILTIN_NAMES = [scheme.name for scheme in BUILTIN_SCHEMES]
"""Every built-in scheme, from the registry (a new one needs its SCHEME_OVERRIDES entry)."""


def test_no_scheme_builds_the_plain_model(tmp_path):
    cfg = scheme_config(tmp_path, None)
    for index in range(cfg.model.num_layers):
        mine, plain = build_layer(cfg, index), base_build_layer(cfg.model, cfg.job.seed, index)
        assert type(mine) is type(plain)
        for (n1, t1), (n2, t2) in zip(
            mine.state_dict().items(), plain.state_dict().items(), strict=True
        ):
            assert n1 == n2 and torch.equal(t1, t2)
    assert activation_spec(cfg, 2) == {"h": ((2, 32, 32), torch.float32)}
    assert SchemeController(cfg).step_end(0, [], lambda o: [o]) == []


def test_scheme_block_without_features_equals_block_bitwise(tmp_path):
    """The block every scheme plugs into computes exactly what the plain block computes."""
    cfg = scheme_config(tmp_path, None)
    plain = base_build_layer(cfg.model, cfg.job.seed, 2)
    assert isinstance(plain, Block)
    block = SchemeBlock(cfg.model, cfg.model.d_ff)
    block.load_state_dict(plain.state_dict())
    h = torch.randn(2, 32, 32, requires_grad=True)
    from dynmo_hpc.model.gpt import MicrobatchContext

    ctx = MicrobatchContext(
        tokens=torch.zeros(2, 32, dtype=torch.long), targets=torch.zeros(2, 32, dtype=torch.long)
    )
    y1, y2 = plain({"h": h}, ctx)["h"], block({"h": h}, ctx)["h"]
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    (g1,) = torch.autograd.grad(y1, h, g)
    (g2,) = torch.autograd.grad(y2, h, g)
    assert torch.equal(g1, g2)


def test_scheme_layers_init_is_rank_independent(tmp_path):
    """Any rank builds the same layer: building twice gives the same bits."""
    for scheme in BUILTIN_NAMES:
        cfg = scheme_config(tmp_path, scheme)
        for index in range(cfg.model.num_layers):
            a, b = build_layer(cfg, index), build_layer(cfg, index)
            for t1, t2 in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
                assert torch.equal(t1, t2), (scheme, index)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("schemes.moe.top_k", "5", "need 1 <= top_k <= num_experts"),
        ("schemes.moe.layers", "[0]", "outside the blocks 1..4"),
        ("schemes.moe.num_expert", "4", "unknown key 'schemes.moe.num_expert'"),
        ("schemes.pruning.end_step", "7", "not a multiple of interval_steps"),
        ("schemes.sparse_attention.block_size", "5", "choose a block size dividing seq_len"),
        ("schemes.sparse_attention.layer_density", "[0.5]", "give one per selected block"),
        ("schemes.mod.capacity", "0.0", "must be in (0, 1]"),
        ("schemes.early_exit.threshold", "2.0", "must be in [0, 1]"),
        ("schemes.freezing.max_frozen_layers", "9", "the head never freezes"),
    ],
)
def test_config_errors_name_the_key_and_fix(tmp_path, key, value, message):
    with pytest.raises(config_mod.ConfigError, match=re.escape(message)):
        scheme_config(tmp_path, None, f"{key}={value}")


def test_incompatible_schemes_are_rejected(tmp_path):
    with pytest.raises(config_mod.ConfigError, match="enable one of them"):
        scheme_config(tmp_path, None, "schemes.early_exit={}", "schemes.mod={}")
    with pytest.raises(config_mod.ConfigError, match="make the two layer lists disjoint"):
        scheme_config(tmp_path, None, "schemes.mod={}", "schemes.sparse_attention.block_size=8")


def test_scheme_stats_add_up_every_replicas_counts(tmp_path):
    """Issue 42, defect 8: with 2 replicas each runs half the batch; the ``scheme_stats``
    counts (MoE expert assignments here) must be the whole batch's, not replica 0's."""
    from types import SimpleNamespace

    from dynmo_hpc.model.schemes import take_counters

    cfg = scheme_config(tmp_path, "moe", "pipeline.replicas=2")
    module = build_layer(cfg, 1)
    module.mlp.stats.update({"expert_0": 3.0, "expert_1": 5.0})  # the MoE router's counts
    # the other replica's copy of layer 1 counted one token per expert
    other = {
        1: {where: dict.fromkeys(v, 1.0) for where, v in take_counters(module, clear=False).items()}
    }
    events = SchemeController(cfg).step_end(
        cfg.train.steps - 1,  # the last step always reports
        [SimpleNamespace(index=1, module=module)],
        lambda mine: [mine],  # the pipeline: one stage here
        lambda mine: [mine, other],  # this stage in both replicas
    )
    (stats,) = [e["layers"]["1"] for e in events if e["kind"] == "scheme_stats"]
    counts = {k.rpartition(".")[2]: v for k, v in stats.items() if "expert_" in k}
    assert counts == {"expert_0": 4.0, "expert_1": 6.0}
