"""Hugging Face ``config.json`` <-> the ``model:`` section, for ``model.init_from`` and export.

Why here, in the config layer: ``model.init_from`` decides the model's shapes, and every rank
must build the same model from the resolved config, so the translation happens while the job's
YAML is loaded (pure JSON work, no torch). ``config.json`` wins over the job's model keys; each
key the job set to another value gets one warning line with both values.

Supported architectures (``architectures[0]``): ``LlamaForCausalLM`` (``model.arch: llama``) and
``GPT2LMHeadModel`` (``model.arch: gpt2``). A config feature the model does not implement
(``rope_scaling``, attention or MLP biases on Llama, a sliding window, a head size other than
``hidden_size / num_attention_heads``, an activation other than SiLU / tanh GELU) is refused
with one line naming the file and the key. Invariant: :func:`hf_config_for` of a translated
section translates back to the same model keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynmo_hpc.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"

ModelKeys = dict[str, Any]
"""``model:`` keys (``num_blocks``, ``d_model``, ...) -> values."""


def _require(hf: dict[str, Any], key: str, source: str) -> Any:
    if key not in hf:
        raise ConfigError(
            f"{source}: no '{key}'; HINT: a {CONFIG_FILE} saved by transformers has it"
        )
    return hf[key]


def _refuse(source: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        f"{source}: {key}={value!r} is not supported ({why}); HINT: only plain Llama and GPT-2 "
        "models import (see docs/models.md)"
    )


def _llama_keys(hf: dict[str, Any], source: str) -> ModelKeys:
    d_model = int(_require(hf, "hidden_size", source))
    num_heads = int(_require(hf, "num_attention_heads", source))
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _refuse(source, key, hf[key], "llama blocks have no biases")
    if hf.get("rope_scaling"):
        raise _refuse(source, "rope_scaling", hf["rope_scaling"], "plain RoPE only")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise _refuse(source, "rope_parameters.rope_type", rope["rope_type"], "plain RoPE only")
    if hf.get("sliding_window") is not None:
        raise _refuse(source, "sliding_window", hf["sliding_window"], "full causal attention")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(source, "hidden_act", hf["hidden_act"], "SwiGLU uses silu")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * num_heads != d_model:
        raise _refuse(source, "head_dim", head_dim, "it must be hidden_size / heads")
    return {
        "arch": "llama",
        "num_blocks": int(_require(hf, "num_hidden_layers", source)),
        "d_model": d_model,
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "d_ff": int(_require(hf, "intermediate_size", source)),
        "vocab_size": int(_require(hf, "vocab_size", source)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def _gpt2_keys(hf: dict[str, Any], source: str) -> ModelKeys:
    d_model = int(_require(hf, "n_embd", source))
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise _refuse(source, "activation_function", activation, "GELU only")
    for key in (
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "add_cross_attention",
    ):
        if hf.get(key):
            raise _refuse(source, key, hf[key], "plain GPT-2 attention only")
    if hf.get("scale_attn_weights", True) is not True:
        raise _refuse(source, "scale_attn_weights", hf["scale_attn_weights"], "1/sqrt(d) scaling")
    return {
        "arch": "gpt2",
        "num_blocks": int(_require(hf, "n_layer", source)),
        "d_model": d_model,
        "num_heads": int(_require(hf, "n_head", source)),
        "d_ff": int(hf.get("n_inner") or 4 * d_model),
        "vocab_size": int(_require(hf, "vocab_size", source)),
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "activation": "gelu" if activation == "gelu" else "gelu_tanh",
        "max_positions": int(_require(hf, "n_positions", source)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


HF_ARCHITECTURES: dict[str, Callable[[dict[str, Any], str], ModelKeys]] = {
    "LlamaForCausalLM": _llama_keys,
    "GPT2LMHeadModel": _gpt2_keys,
}
"""Hugging Face ``architectures[0]`` -> the translator of its config.json into model keys."""

HF_ARCH_NAMES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
"""``model.arch`` -> the Hugging Face class an export is loaded as."""


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory (one-line errors)."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file; HINT: model.init_from names a Hugging Face model directory "
            "(config.json and *.safetensors, as save_pretrained writes it)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); HINT: save it again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is not a JSON object")
    return data


def model_keys_from_hf(directory: str | Path) -> ModelKeys:
    """The model keys ``directory``'s config.json implies (ConfigError if unsupported)."""
    hf = read_hf_config(directory)
    source = str(Path(directory) / CONFIG_FILE)
    architectures = hf.get("architectures") or [hf.get("model_type")]
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    if name not in HF_ARCHITECTURES:
        raise ConfigError(
            f"{source}: architectures={architectures!r} is not supported; HINT: import one of "
            f"{', '.join(HF_ARCHITECTURES)}"
        )
    return HF_ARCHITECTURES[name](hf, source)


def apply_init_from(model: dict[str, Any]) -> dict[str, Any]:
    """The job's ``model:`` mapping with ``init_from``'s config.json keys applied over it.

    One warning line per key the job set to a different value; keys the job left out are filled
    in silently. ``tie_word_embeddings`` (transformers' default: true for GPT-2, false for
    Llama) sets ``tie_embeddings``. Returns a new mapping; ``model`` is not changed.
    """
    directory = model.get("init_from")
    if directory is None:
        return model
    keys = model_keys_from_hf(str(directory))
    for key, value in keys.items():
        if key in model and model[key] is not None and model[key] != value:
            log.warning(
                "model.%s=%r differs from %s's config.json (%r): using %r",
                key,
                model[key],
                directory,
                value,
                value,
            )
    if "layer_d_ff" in model and model["layer_d_ff"] is not None:
        raise ConfigError(
            "model.layer_d_ff cannot be combined with model.init_from (config.json sets one "
            "d_ff for every block); HINT: remove model.layer_d_ff"
        )
    return {**model, **keys}


def hf_config_for(model: Any) -> dict[str, Any]:
    """A transformers ``config.json`` for a ``ModelSection`` (``tie_word_embeddings`` as
    ``model.tie_embeddings``)."""
    common = {
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "dtype": "float32",
    }
    if model.arch == "llama":
        return {
            "architectures": [HF_ARCH_NAMES["llama"]],
            "model_type": "llama",
            "hidden_size": model.d_model,
            "intermediate_size": model.d_ff,
            "num_hidden_layers": model.num_blocks,
            "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.kv_heads,
            "head_dim": model.d_model // model.num_heads,
            "hidden_act": "silu",
            "max_position_embeddings": model.seq_len,
            "rms_norm_eps": model.norm_eps,
            "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
            "attention_bias": False,
            "mlp_bias": False,
            **common,
        }
    return {
        "architectures": [HF_ARCH_NAMES["gpt2"]],
        "model_type": "gpt2",
        "n_embd": model.d_model,
        "n_inner": model.d_ff,
        "n_layer": model.num_blocks,
        "n_head": model.num_heads,
        "n_positions": model.num_positions,
        "layer_norm_epsilon": model.norm_eps,
        "activation_function": "gelu_new" if model.activation == "gelu_tanh" else "gelu",
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        **common,
    }
