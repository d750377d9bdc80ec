"""Export a model as a Hugging Face directory: ``config.json`` and ``model.safetensors``.

What each scheme exports (the table :data:`SCHEME_EXPORT` is what ``dynmo-hpc export`` and
docs/models.md say):

* ``pruning``: removed neurons and heads as zero rows and columns of the dense matrices; the
  function is unchanged (a zero neuron adds nothing, a zero head's output columns are zero);
* ``freezing``: frozen layers as they are (freezing changes training, not the function);
* ``mod``, ``early_exit``, ``sparse_attention``: Hugging Face cannot express routing, early
  exits or block-sparse attention. Refused, unless ``dense_backbone``: the blocks are exported
  without their routers and exit heads and with dense causal attention, so every token runs
  every block in full (the function changes; the weights are the trained ones);
* ``moe``: refused (a mixture-of-experts block has no dense feed-forward to export).

With ``tokenizer`` (the ``tokenizer.json`` the run's data was tokenized with), the directory also
holds that file and a ``tokenizer_config.json`` naming the fast tokenizer class, so
``transformers.AutoTokenizer`` loads it beside the model.

The head is exported as the model trained it: untied (``tie_word_embeddings: false``, its own
``lm_head.weight``), or with ``model.tie_embeddings`` tied (``tie_word_embeddings: true``, no
``lm_head.weight``: the embedding's copy, bitwise equal to the head's, is the one weight).
Nothing is half-written: the files go to a temporary directory beside ``out``, renamed to
``out`` when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dynmo_hpc.checkpoint.model_files import LoadedModel
from dynmo_hpc.config.hf_model import CONFIG_FILE, hf_config_for
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.hf_weights import SINGLE_FILE, dense_state, export_tensors, save_safetensors

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast"}
"""What ``tokenizer_config.json`` says: the class that wraps a ``tokenizer.json``."""

EXACT = "exact"
BACKBONE = "backbone"
REFUSED = "refused"

SCHEME_EXPORT: dict[str, tuple[str, str]] = {
    "pruning": (EXACT, "pruned neurons and heads are zeros in the dense weights"),
    "freezing": (EXACT, "frozen layers are exported as they are"),
    "mod": (BACKBONE, "the depth routers are dropped: every token runs every block"),
    "early_exit": (BACKBONE, "the exit heads are dropped: every token runs every block"),
    "sparse_attention": (BACKBONE, "attention is dense causal instead of block-sparse"),
    "moe": (REFUSED, "an MoE block has no dense feed-forward"),
}
"""Scheme -> (how it exports, what that means). A scheme not listed is refused."""


def export_notes(schemes: list[str], dense_backbone: bool) -> list[str]:
    """One line per enabled scheme saying what the export does with it.

    Raises:
        CheckpointError: a scheme Hugging Face cannot express (without ``dense_backbone``
            where that is allowed).
    """
    notes = []
    for name in schemes:
        how, what = SCHEME_EXPORT.get(name, (REFUSED, "no export rule for this scheme"))
        if how == REFUSED:
            raise CheckpointError(
                f"schemes.{name} cannot be exported to Hugging Face: {what}; HINT: export a "
                "checkpoint trained without it"
            )
        if how == BACKBONE and not dense_backbone:
            raise CheckpointError(
                f"schemes.{name} cannot be expressed in Hugging Face ({what} would change the "
                "function); HINT: pass --dense-backbone to export the dense backbone anyway"
            )
        notes.append(f"schemes.{name}: {what}")
    return notes


def export_model(
    loaded: LoadedModel,
    out: Path,
    *,
    dense_backbone: bool = False,
    tokenizer: Path | None = None,
) -> list[str]:
    """Write ``loaded`` to the new directory ``out`` (with ``tokenizer``'s files when given);
    returns the per-scheme notes.

    Raises:
        CheckpointError: ``out`` exists and is not empty, a scheme cannot be exported, or the
            blocks have different feed-forward widths (one ``intermediate_size`` in config.json).
    """
    cfg = loaded.cfg
    notes = export_notes(cfg.schemes.enabled, dense_backbone)
    widths = sorted({cfg.model.block_d_ff(i) for i in range(1, cfg.model.num_blocks + 1)})
    if len(widths) > 1:
        raise CheckpointError(
            f"model.layer_d_ff gives the blocks widths {widths}; a Hugging Face config has one "
            "intermediate_size; HINT: export a model with one d_ff"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory; HINT: pick a new --out")
    tensors = {}
    for index, layer in enumerate(loaded.layers):
        state = dense_state(cfg.model, index, layer.state_dict())
        tensors.update(export_tensors(cfg.model, index, state))
    hf_config = hf_config_for(cfg.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_safetensors(tensors, tmp / SINGLE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
            (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for note in notes:
        log.info("export: %s", note)
    return notes
