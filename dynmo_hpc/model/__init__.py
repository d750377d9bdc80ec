"""The model: GPT layers that can be placed on any stage, their optimizer, and the schemes.

- :mod:`~dynmo_hpc.model.gpt`: embedding, transformer block and head as placeable layers.
- :mod:`~dynmo_hpc.model.optim`: per-layer AdamW, the LR schedule, global-norm clipping.
- :mod:`~dynmo_hpc.model.schemes`: the six dynamic schemes that change per-layer cost.
"""
