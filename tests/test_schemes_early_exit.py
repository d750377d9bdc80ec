"""Early exit: exited tokens are not computed by later layers, and the loss still covers them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.gpt import build_layer as base_build_layer
from dynmo_hpc.model.schemes import activation_spec, build_layer
from tests.helpers.scheme_jobs import scheme_config


def _batch(cfg, step=0):
    dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
    tokens, targets = dataset.batch(cfg.job.seed, step, 0, cfg.train.micro_batch_size)
    return MicrobatchContext(tokens=tokens, targets=targets)


def _forward(layers, ctx):
    x, payloads = None, []
    for layer in layers:
        x = layer(x, ctx)
        payloads.append(x)
    return payloads


def test_payload_carries_the_active_mask_and_exit_losses(tmp_path):
    cfg = scheme_config(tmp_path, "early_exit")
    spec = activation_spec(cfg, 2)
    assert spec["active"] == ((2, 32), torch.float32)
    assert spec["exit_nll"] == ((2, 32), torch.float32)


def test_exited_tokens_are_not_computed_by_later_layers(tmp_path):
    cfg = scheme_config(tmp_path, "early_exit", "schemes.early_exit.threshold=0.0056")
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    rows: dict[int, int] = {}
    for i in range(1, 5):
        layers[i].ln_2.register_forward_hook(
            lambda mod, inp, out, i=i: rows.__setitem__(i, inp[0].reshape(-1, 32).shape[0])
        )
    ctx = _batch(cfg)
    payloads = _forward(layers, ctx)
    active = [p["active"].bool() for p in payloads[:-1]]
    counts = [int(a.sum()) for a in active]
    assert counts[0] == 64 and counts[1] < 64 and counts[3] < counts[1] and counts[3] > 0, counts
    for i in range(2, 5):  # a block's feed-forward sees exactly the tokens active at its input
        assert rows[i] == counts[i - 1]
    for i in range(2, 5):  # an exited token's hidden state passes each later block unchanged
        gone = ~active[i - 1]
        assert torch.equal(payloads[i]["h"][gone], payloads[i - 1]["h"][gone])
    # Exited tokens carry their exit loss; active ones carry none.
    last = payloads[4]
    assert torch.all(last["exit_nll"][~last["active"].bool()] > 0)
    assert torch.all(last["exit_nll"][last["active"].bool()] == 0)


def test_loss_covers_every_token_at_the_layer_it_exited(tmp_path):
    """All tokens exit after block 1: the loss is block 1's exit cross-entropy; nothing else
    runs."""
    cfg = scheme_config(tmp_path, "early_exit", "schemes.early_exit.threshold=0.0")
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    calls = []
    layers[2].ln_1.register_forward_hook(lambda *a: calls.append(2))
    layers[5].ln_f.register_forward_hook(lambda *a: calls.append(5))
    ctx = _batch(cfg)
    payloads = _forward(layers, ctx)
    head1 = layers[1].exit_head
    logits = head1.proj(head1.ln(payloads[1]["h"]))
    want = F.cross_entropy(logits.view(-1, 256), ctx.targets.view(-1))
    torch.testing.assert_close(ctx.loss, want)
    assert calls == [5]  # block 2 computed nothing; the head's norm ran on zero tokens
    assert layers[2].token_stats["processed"] == 0


def test_without_exits_the_model_is_the_plain_model(tmp_path):
    cfg = scheme_config(tmp_path, "early_exit", "schemes.early_exit.threshold=1.0")
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    plain = [base_build_layer(cfg.model, cfg.job.seed, i) for i in range(cfg.model.num_layers)]
    ctx, ctx_plain = _batch(cfg), _batch(cfg)
    _forward(layers, ctx)
    _forward(plain, ctx_plain)
    torch.testing.assert_close(ctx.loss, ctx_plain.loss)
    assert len(ctx.aux_losses) == 3  # one exit loss per exit head trains the exits


def test_active_query_attention_equals_full_attention_at_active_positions(tmp_path):
    cfg = scheme_config(tmp_path, "early_exit")
    attn = build_layer(cfg, 2).attn
    hn = torch.randn(2, 32, 32)
    gen = torch.Generator().manual_seed(0)
    active = torch.rand(2, 32, generator=gen) < 0.4
    active[1, :3] = True
    b_idx, t_idx = active.nonzero(as_tuple=True)
    got = attn.attend_active(hn, active, b_idx, t_idx)
    want = attn(hn)[b_idx, t_idx]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
