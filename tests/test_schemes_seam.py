"""The scheme seam: a seventh scheme, defined and registered here alone, trains end to end.

``LayerDrop`` skips the feed-forward of chosen blocks (the residual carries the attention output
past it) and counts the tokens it skipped under a counter attribute no other scheme uses. The
test registers the class (nothing outside this file is edited), loads ``schemes.layer_drop``
from the job overrides, trains with the library's single-process reference, and finds the
scheme's effect in the losses and parameters, its counter in the ``scheme_stats`` events and in
a layer's checkpoint file, and its summary in the controller's run state.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint import store
from dynmo_hpc.cli.bench import scheme_jobs
from dynmo_hpc.config import ModelSection
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.model.gpt import MicrobatchContext, Payload
from dynmo_hpc.model.schemes import (
    BUILTIN_SCHEMES,
    SCHEMES,
    SchemeController,
    build_layer,
    register,
    unregister,
)
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import ROOT, tiny_config
from tests.helpers.scheme_jobs import SCHEME_OVERRIDES

STEPS = 3


@dataclass(frozen=True, kw_only=True)
class LayerDropSection:
    layers: list[int] = field(default_factory=lambda: [1])
    """Blocks whose feed-forward is skipped (global indices 1..num_blocks)."""

    def validate(self) -> None:
        if not self.layers:
            raise ConfigError("schemes.layer_drop.layers=[] drops nothing; list block indices")

    def validate_for(self, model: ModelSection) -> None:
        bad = [i for i in self.layers if not 1 <= i <= model.num_blocks]
        if bad:
            raise ConfigError(f"schemes.layer_drop.layers has {bad} outside 1..{model.num_blocks}")


def attention_only_forward(block: Any, x: Payload, ctx: MicrobatchContext) -> Payload:
    h = x["h"]  # (B, T, C)
    h = h + block.attn(block.ln_1(h))
    skipped = block.drop_stats.get("skipped_tokens", 0.0)
    block.drop_stats["skipped_tokens"] = skipped + float(h.shape[0] * h.shape[1])
    return {**x, "h": h}


class LayerDrop(Scheme):
    name = "layer_drop"
    section_type = LayerDropSection
    changes_block = True
    counter_attrs = ("drop_stats",)

    def configure_block(self, block: Any, index: int) -> None:
        if index in self.section.layers:
            block.forward_path = attention_only_forward
            block.drop_stats = {}

    def step_end(
        self, step: int, slots: Sequence[Slot], allgather: AllGather
    ) -> dict[str, Any] | None:
        return {"kind": "layer_drop", "dropped": list(self.section.layers)}

    def summary(self) -> dict[str, Any]:
        return {"dropped_layers": list(self.section.layers)}


@pytest.fixture
def layer_drop() -> Iterator[None]:
    register(LayerDrop)
    try:
        yield
    finally:
        unregister("layer_drop")


def _configs(tmp_path: Any) -> tuple[config_mod.JobConfig, config_mod.JobConfig]:
    plain = tiny_config(tmp_path, f"train.steps={STEPS}", "balance.interval=1")
    dropped = tiny_config(
        tmp_path, f"train.steps={STEPS}", "balance.interval=1", "schemes.layer_drop.layers=[1,3]"
    )
    return plain, dropped


def test_registered_scheme_loads_and_unknown_names_list_it(tmp_path, layer_drop):
    _, cfg = _configs(tmp_path)
    assert cfg.schemes.enabled == ["layer_drop"]
    assert cfg.schemes.layer_drop == LayerDropSection(layers=[1, 3])
    assert cfg.to_dict()["schemes"]["layer_drop"] == {"layers": [1, 3]}
    with pytest.raises(ConfigError, match=r"valid keys under 'schemes' are: moe, .*layer_drop"):
        tiny_config(tmp_path, "schemes.layer_dorp.layers=[1]")
    with pytest.raises(ConfigError, match=r"schemes.layer_drop.layers has \[9\] outside 1..4"):
        tiny_config(tmp_path, "schemes.layer_drop.layers=[9]")


def test_a_seventh_scheme_trains_reports_and_checkpoints(tmp_path, layer_drop):
    plain_cfg, cfg = _configs(tmp_path)
    plain, run = train_reference(plain_cfg), train_reference(cfg)
    assert all(a != b for a, b in zip(plain.losses, run.losses, strict=True))
    initial = build_layer(cfg, 1).state_dict()
    for name, value in run.state[1].items():  # a skipped feed-forward (and its norm) never trains
        assert torch.equal(value, initial[name]) == name.startswith(("mlp.", "ln_2.")), name
    assert not torch.equal(run.state[2]["mlp.c_fc.weight"], plain.state[2]["mlp.c_fc.weight"])

    tokens_per_step = cfg.tokens_per_step
    stats = [e for e in run.events if e["kind"] == "scheme_stats"]
    assert [e["step"] for e in stats] == list(range(STEPS))  # balance.interval=1: every step
    for event in stats:
        assert event["schemes"] == ["layer_drop"] and event["dropped_layers"] == [1, 3]
        assert event["no_grad_below"] == 0
        for layer in ("1", "3"):
            assert event["layers"][layer] == {"skipped_tokens": float(tokens_per_step)}
        assert event["layers"]["2"] == {}
    assert len([e for e in run.events if e["kind"] == "layer_drop"]) == STEPS
    assert SchemeController(cfg).run_state() == {"no_grad_below": 0, "dropped_layers": [1, 3]}


def test_a_seventh_scheme_counter_is_checkpointed(tmp_path, layer_drop):
    _, cfg = _configs(tmp_path)
    embedding, block = build_layer(cfg, 0), build_layer(cfg, 1)
    tokens = torch.zeros(2, cfg.model.seq_len, dtype=torch.long)
    ctx = MicrobatchContext(tokens=tokens, targets=tokens)
    block(embedding(None, ctx), ctx)
    optimizer = torch.optim.AdamW(block.parameters())
    payload = torch.load(io.BytesIO(store.layer_bytes(1, block, optimizer)))
    assert payload["counters"][":drop_stats"] == {"skipped_tokens": float(tokens.numel())}
    fresh = build_layer(cfg, 1)
    store.restore_counters(fresh, payload["counters"])
    assert fresh.drop_stats == block.drop_stats


def test_unregistering_removes_the_scheme(tmp_path):
    register(LayerDrop)
    unregister("layer_drop")
    with pytest.raises(ConfigError, match=r"unknown key 'schemes\.layer_drop'"):
        tiny_config(tmp_path, "schemes.layer_drop.layers=[1]")


def test_every_builtin_scheme_has_a_job_and_test_overrides():
    """The registry is the list: each built-in scheme has its job (which the bench offers) and
    the overrides the shared scheme tests run it with."""
    names = [scheme.name for scheme in BUILTIN_SCHEMES]
    assert list(SCHEMES) == names and list(config_mod.SCHEME_SECTIONS) == names
    assert set(SCHEME_OVERRIDES) == set(names)
    assert list(scheme_jobs()) == ["plain", *names]
    for name, job in scheme_jobs().items():
        for job_set in ("natural", "stress"):
            cfg = config_mod.load(ROOT / "jobs" / job_set / job)
            assert cfg.schemes.enabled == ([] if name == "plain" else [name])
