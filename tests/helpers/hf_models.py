"""Tiny Hugging Face models built by transformers itself (random weights from a config, nothing
downloaded), saved with ``save_pretrained``: the yardstick no one here wrote for the model
families, the importer, ``eval`` and ``export``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 300
"""Above the byte vocabulary, so the byte-level data trains these models too."""


def llama_config(**overrides: Any) -> Any:
    import transformers

    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def gpt2_config(**overrides: Any) -> Any:
    import transformers

    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "n_embd": 32,
        "n_layer": 3,
        "n_head": 2,
        "n_positions": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


def save_model(
    directory: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Build a random ``arch`` ("llama" or "gpt2") model, save it to ``directory``; returns it."""
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(llama_config(**overrides))
    else:
        model = transformers.GPT2LMHeadModel(gpt2_config(**overrides))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def load_model(directory: Path) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in fp32 with its loading report."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    return model, info


@torch.no_grad()
def hf_loss(model: Any, batch: torch.Tensor) -> float:
    """transformers' own loss on windows (N, L+1): ``labels=input_ids``, shifted inside."""
    return float(model(input_ids=batch, labels=batch).loss)
