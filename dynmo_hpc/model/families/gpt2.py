"""The ``gpt2`` family: the layers of :mod:`dynmo_hpc.model.gpt`, and GPT-2's Hugging Face names.

The layers themselves live in :mod:`dynmo_hpc.model.gpt` (the schemes' block extends its
``Block``); this module registers them and maps them onto ``GPT2LMHeadModel``'s tensors.
GPT-2 stores its projections as ``Conv1D`` weights, (in, out), transposed against our
``nn.Linear``; ``c_attn`` packs q, k and v along the output in both layouts, so the fused
matrix needs a transpose and no reshuffle. Its head is tied to ``wte``: without an
``lm_head.weight`` the head reads ``transformer.wte.weight``.
"""

from __future__ import annotations

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.families.registry import Family, HFTensor, register
from dynmo_hpc.model.gpt import Block, Embedding, Head, init_layer_, layer_kind

_BLOCK = {
    "ln_1.weight": False,
    "ln_1.bias": False,
    "attn.c_attn.weight": True,
    "attn.c_attn.bias": False,
    "attn.c_proj.weight": True,
    "attn.c_proj.bias": False,
    "ln_2.weight": False,
    "ln_2.bias": False,
    "mlp.c_fc.weight": True,
    "mlp.c_fc.bias": False,
    "mlp.c_proj.weight": True,
    "mlp.c_proj.bias": False,
}
"""Block parameter -> stored transposed (Conv1D) in ``transformer.h.<i>``."""


def hf_tensors(cfg: ModelSection, index: int) -> dict[str, HFTensor]:
    """Our parameter names of layer ``index`` -> their ``GPT2LMHeadModel`` tensors."""
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return {
            "wte.weight": HFTensor("transformer.wte.weight"),
            "wpe.weight": HFTensor("transformer.wpe.weight"),
        }
    if kind == "head":
        return {
            "ln_f.weight": HFTensor("transformer.ln_f.weight"),
            "ln_f.bias": HFTensor("transformer.ln_f.bias"),
            "lm_head.weight": HFTensor("lm_head.weight", fallback="transformer.wte.weight"),
        }
    return {
        name: HFTensor(f"transformer.h.{index - 1}.{name}", transposed=t)
        for name, t in _BLOCK.items()
    }


GPT2 = register(
    Family(
        name="gpt2",
        build_embedding=Embedding,
        build_block=Block,
        build_head=Head,
        embedding_weight="wte.weight",
        init_layer=init_layer_,
        hf_tensors=hf_tensors,
        packed={"attn.c_attn.weight": 3, "attn.c_attn.bias": 3},
    )
)
