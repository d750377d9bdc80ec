"""The llama family's scheme block: the plain block's numbers when no scheme acts, positions
that follow the tokens (MoD), block-sparse attention with RoPE and grouped-query attention.

Pipeline parity of each supported scheme on llama is in ``test_schemes_parity.py``; the
schemes llama does not support are refused by the config (``test_models.py``).
"""

from __future__ import annotations

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.families import llama
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.model.schemes.llama_blocks import LlamaSchemeAttention, LlamaSchemeBlock

MODEL = {
    "arch": "llama",
    "num_blocks": 2,
    "d_model": 32,
    "num_heads": 4,
    "num_kv_heads": 2,
    "d_ff": 48,
    "seq_len": 16,
}


def _cfg(**schemes: object) -> config_mod.JobConfig:
    return config_mod.from_dict({"model": MODEL, "schemes": schemes})


def _attention(seed: int = 0) -> LlamaSchemeAttention:
    torch.manual_seed(seed)
    attn = LlamaSchemeAttention(_cfg().model)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn


def test_scheme_block_without_a_scheme_is_the_plain_block_bitwise():
    cfg = _cfg(freezing={})  # a scheme that leaves blocks alone: plain LlamaBlock
    plain = build_layer(cfg, 1)
    assert type(plain) is llama.LlamaBlock
    block = LlamaSchemeBlock(cfg.model, cfg.model.d_ff)
    llama.init_layer_(block, cfg.model, cfg.job.seed, 1)
    plain_state = plain.state_dict()
    assert list(block.state_dict()) == [k for k in plain_state if not k.startswith("frozen")]
    for name, tensor in block.state_dict().items():
        assert torch.equal(tensor, plain_state[name]), name
    x = {"h": torch.randn(2, 16, 32)}
    ctx = MicrobatchContext(tokens=torch.zeros(2, 16, dtype=torch.long), targets=None)  # type: ignore[arg-type]
    assert torch.equal(block(x, ctx)["h"], plain(x, ctx)["h"])


def test_positions_default_to_the_sequence_and_rope_is_relative():
    attn = _attention()
    x = torch.randn(2, 10, 32)
    pos = torch.arange(10).expand(2, 10)
    torch.testing.assert_close(attn(x, positions=pos), attn(x), rtol=1e-6, atol=1e-6)
    # shifting every position by the same offset leaves attention unchanged (relative positions)
    torch.testing.assert_close(attn(x, positions=pos + 7), attn(x), rtol=1e-4, atol=1e-5)
    # spreading them apart does not
    assert not torch.allclose(attn(x, positions=pos * 3), attn(x), rtol=1e-3, atol=1e-4)


def test_routed_tokens_keep_their_positions():
    """A token subset attended with its original positions equals the full attention whose
    other keys are masked out: what MoD's routed path must compute."""
    attn = _attention(1)
    x = torch.randn(1, 12, 32)
    keep = torch.tensor([[0, 3, 4, 9, 11]])
    sub = attn(x[:, keep[0]], positions=keep)  # (1, 5, C)
    # the same through an explicit mask over all 12 tokens
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, 2, 8).transpose(1, 2)
    cos, sin = llama.rope_cos_sin(T, 8, attn.rope_theta, x.device)
    q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    idx = keep[0]
    allowed[idx[:, None], idx[None, :]] = idx[:, None] >= idx[None, :]
    allowed[~allowed.any(1), 0] = True  # rows not kept: any key, discarded below
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    want = attn.o_proj(y.transpose(1, 2).reshape(B, T, 32))[:, idx]
    torch.testing.assert_close(sub, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_sparse_attention_at_full_density_is_dense_gqa_attention(num_kv_heads):
    cfg = config_mod.from_dict({"model": {**MODEL, "num_kv_heads": num_kv_heads}})
    torch.manual_seed(2)
    attn = LlamaSchemeAttention(cfg.model)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 16, 32)
    dense = attn(x)
    attn.make_sparse(block_size=4, density=1.0)
    torch.testing.assert_close(attn(x), dense, rtol=1e-5, atol=1e-6)
    attn.make_sparse(block_size=4, density=0.25)
    assert not torch.allclose(attn(x), dense, rtol=1e-3, atol=1e-4)
    assert attn.stats["kept_blocks"] < attn.stats["causal_blocks"]


def test_llama_blocks_with_schemes_keep_hugging_face_names():
    cfg = _cfg(mod={"layers": [1]}, sparse_attention={"block_size": 4, "layers": [2]})
    routed, sparse = build_layer(cfg, 1), build_layer(cfg, 2)
    hf = {"self_attn.q_proj.weight", "mlp.gate_proj.weight", "input_layernorm.weight"}
    assert hf <= set(dict(routed.named_parameters())) and routed.depth_router is not None
    assert hf <= set(dict(sparse.named_parameters()))
    assert "self_attn.density" in sparse.state_dict()


def test_pruning_a_kv_group_and_neurons_equals_zeroing_them():
    """Removing key/value group 1 and SwiGLU neurons 3 and 7 computes what the dense block
    computes with those structures' weights zeroed; export pads them back as zeros."""
    from dynmo_hpc.model.hf_weights import dense_state
    from dynmo_hpc.model.optim import build_optimizer
    from dynmo_hpc.model.schemes.pruning import apply_removals

    cfg = _cfg(pruning={"min_heads": 1})
    block = build_layer(cfg, 1)
    assert isinstance(block, LlamaSchemeBlock)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    zeroed = LlamaSchemeBlock(cfg.model, cfg.model.d_ff)
    zeroed.load_state_dict(block.state_dict(), strict=False)
    with torch.no_grad():  # group 1 = query heads 2, 3 (rows 16..31) and kv head 1 (rows 8..15)
        zeroed.self_attn.q_proj.weight[16:32] = 0
        zeroed.self_attn.o_proj.weight[:, 16:32] = 0
        zeroed.self_attn.k_proj.weight[8:16] = 0
        zeroed.self_attn.v_proj.weight[8:16] = 0
        for n in (3, 7):
            zeroed.mlp.gate_proj.weight[n] = 0
            zeroed.mlp.up_proj.weight[n] = 0
            zeroed.mlp.down_proj.weight[:, n] = 0

    class Slot:
        module = block
        optimizer = build_optimizer(block, cfg.train)
        in_arena = False

    apply_removals(Slot, {"self_attn": [1], "mlp": [3, 7]}, cfg.schemes.pruning, cfg)
    assert (block.attn.num_heads, block.attn.num_kv_heads) == (2, 1)
    assert block.mlp.up_proj.out_features == cfg.model.d_ff - 2
    x = {"h": torch.randn(2, 16, 32)}
    ctx = MicrobatchContext(tokens=torch.zeros(2, 16, dtype=torch.long), targets=None)  # type: ignore[arg-type]
    want = zeroed(x, ctx)["h"]
    torch.testing.assert_close(block(x, ctx)["h"], want, rtol=1e-5, atol=1e-6)
    dense = llama.LlamaBlock(cfg.model, cfg.model.d_ff)
    dense.load_state_dict(dense_state(cfg.model, 1, block.state_dict()))
    torch.testing.assert_close(dense(x, ctx)["h"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dispatch", ["gather", "padded"])
def test_moe_with_swiglu_experts_is_the_gated_sum_of_its_experts(dispatch):
    from dynmo_hpc.model.schemes.moe import MoEFeedForward

    cfg = _cfg(moe={"num_experts": 4, "top_k": 2, "capacity_factor": 8.0, "dispatch": dispatch})
    block = build_layer(cfg, 1)
    assert isinstance(block.mlp, MoEFeedForward)
    assert isinstance(block.mlp.experts[0], llama.SwiGLU)
    moe = block.mlp
    x = torch.randn(20, 32)
    out, aux = moe(x)
    probs = torch.softmax(moe.router(x), dim=-1)
    top = probs.topk(2, dim=-1)
    want = torch.zeros_like(x)
    for n in range(20):
        for p, e in zip(top.values[n], top.indices[n], strict=True):
            want[n] += p / top.values[n].sum() * moe.experts[int(e)](x[n : n + 1])[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert aux.requires_grad


def test_attend_active_is_full_attention_at_the_active_tokens():
    """Early exit: the active tokens' outputs (queries at their own positions, keys and values
    from every token) are the full attention's rows at those tokens."""
    attn = _attention(3)
    hn = torch.randn(2, 12, 32)
    active = torch.rand(2, 12) < 0.6
    active[:, 0] = True
    b_idx, t_idx = active.nonzero(as_tuple=True)
    full = attn(hn)[b_idx, t_idx]
    torch.testing.assert_close(
        attn.attend_active(hn, active, b_idx, t_idx), full, rtol=1e-5, atol=1e-6
    )


def test_early_exit_llama_layers_use_the_llama_embedding_norm_and_head():
    cfg = _cfg(early_exit={"layers": [1]})
    embedding, block, head = (build_layer(cfg, i) for i in (0, 1, 3))
    assert isinstance(embedding, llama.LlamaEmbedding) and isinstance(head, llama.LlamaHead)
    assert isinstance(block.exit_head.ln, llama.RMSNorm)
    tokens = torch.randint(0, 256, (2, 16))
    ctx = MicrobatchContext(tokens=tokens, targets=torch.roll(tokens, -1, 1))
    x = embedding(None, ctx)
    assert set(x) == {"h", "active", "exit_nll"}
    for layer in (block, build_layer(cfg, 2), head):
        x = layer(x, ctx)
    assert ctx.loss is not None and torch.isfinite(ctx.loss)
