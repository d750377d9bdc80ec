"""Gradual structured magnitude pruning: Zhu & Gupta's cubic schedule, one global criterion.

Schedule (Zhu & Gupta 2017, "To prune, or not to prune"): after optimizer step t in
{t0, t0 + dt, ..., t0 + n dt = end_step} the sparsity becomes
``s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n dt))^3``: fast pruning early, when weights are
redundant, slowing as the final sparsity s_f approaches.

Criterion (``scope: global``, the default): global magnitude. Every prunable structure of every
eligible layer, on every rank, is scored by the L2 norm of its weights; structures of one kind
have equally many weights, so the norm ranks them as per-weight magnitude would. All ranks
allgather the scores and remove the globally smallest until the kind's sparsity reaches s_t; a
layer whose weights are small loses more, so layers end at different sparsities. Neurons and
heads are ranked separately (one global ranking per kind), because a head's and a neuron's
weight norms have different scales.
``scope: layer`` ranks within each block instead: every block reaches s_t itself (per-layer
magnitude pruning, as Zhu & Gupta apply it), so the blocks shrink alike.

Why structured: torch's sparse kernels do not beat dense matmul on CPU at the sparsities this
schedule spends its time at, while the dense matmul of the shrunk matrix is faster than both at
every sparsity (the comparison is in docs/benchmarks.md). So pruning removes whole
feed-forward neurons (a row of ``c_fc`` and a column of ``c_proj``, experts' included) and whole
attention heads (their query, key and value rows of ``c_attn`` and columns of ``c_proj``), and the
matrices physically shrink: the compute reduction is real on any device and the profiler sees it.

On ``llama`` blocks a neuron is a row of ``gate_proj`` and ``up_proj`` and a column of
``down_proj``, and heads go in whole key/value groups (grouped-query attention: a group's query
heads, its key and value head and its ``o_proj`` columns), so the head structure stays valid:
``min_heads`` and the head sparsity count groups there.

Optimizer: the layer's AdamW is rebuilt over the shrunk parameters and keeps the surviving rows'
moments and the step count, so training continues as if the removed rows had never existed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dynmo_hpc.config import JobConfig, ModelSection, PruningSection
from dynmo_hpc.model.families.llama import SwiGLU
from dynmo_hpc.model.gpt import MLP
from dynmo_hpc.model.optim import build_optimizer
from dynmo_hpc.model.schemes.blocks import SchemeAttention, SchemeBlock
from dynmo_hpc.model.schemes.freezing import is_frozen
from dynmo_hpc.model.schemes.llama_blocks import LlamaSchemeAttention, LlamaSchemeBlock
from dynmo_hpc.model.schemes.moe import MoEFeedForward
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot

NEURON = "neuron"
HEAD = "head"


def sparsity_at(section: PruningSection, step: int) -> float | None:
    """Target sparsity after optimizer step ``step`` (0-based), or None if no pruning then.

    Example: s_i=0, s_f=0.8, steps 0..40 every 10: 0.0, 0.4625, 0.7, 0.7875, 0.8.
    """
    t0, end, dt = section.start_step, section.end_step, section.interval_steps
    if step < t0 or step > end or (step - t0) % dt:
        return None
    if end == t0:
        return section.final_sparsity
    frac = (step - t0) / (end - t0)
    s_i, s_f = section.initial_sparsity, section.final_sparsity
    return s_f + (s_i - s_f) * (1.0 - frac) ** 3


def num_head_units(model: ModelSection) -> int:
    """Prunable head structures per block: heads (gpt2), or whole key/value groups (llama:
    a group's query heads, its key and value head and their output columns go together)."""
    return model.kv_heads if model.arch == "llama" else model.num_heads


def eligible_layers(cfg: JobConfig) -> list[int]:
    """Blocks that pruning may shrink."""
    section = cfg.schemes.pruning
    assert section is not None
    if section.layers is not None:
        return list(section.layers)
    return list(range(1, cfg.model.num_blocks + 1))


def initial_counts(cfg: JobConfig, layers: Sequence[int] | None = None) -> dict[str, int]:
    """Prunable structures of each kind at initialisation (the denominators of sparsity), over
    ``layers`` (default: every eligible block)."""
    section = cfg.schemes.pruning
    assert section is not None
    counts = {NEURON: 0, HEAD: 0}
    moe = cfg.schemes.moe
    moe_layers: set[int] = set()
    if moe is not None:
        moe_layers = set(moe.layers or range(1, cfg.model.num_blocks + 1))
    for index in eligible_layers(cfg) if layers is None else layers:
        d_ff = cfg.model.block_d_ff(index)
        if section.prune_neurons:
            if moe is not None and index in moe_layers:
                counts[NEURON] += moe.num_experts * (moe.d_ff_expert or d_ff)
            else:
                counts[NEURON] += d_ff
        if section.prune_heads:
            counts[HEAD] += num_head_units(cfg.model)
    return {kind: n for kind, n in counts.items() if n}


# --------------------------------------------------------------------------------------------
# Scores and the global decision (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Candidate:
    """One prunable structure; the field order is the deterministic global sort key."""

    score: float
    """L2 norm of the structure's weights (float64)."""
    layer: int
    group: str
    """Module path inside the layer (``mlp``, ``mlp.experts.2``, ``attn``)."""
    index: int
    """Current position of the structure within its group."""
    kind: str
    locked: bool = False
    """Counts towards the sparsity but may not be removed (its layer is frozen)."""


def neuron_scores(mlp: MLP | SwiGLU) -> Tensor:
    """(d_ff,) L2 norm of each neuron's input row(s) and output column (SwiGLU: its gate and
    up rows and its down column)."""
    if isinstance(mlp, SwiGLU):
        w_gate = mlp.gate_proj.weight.detach().double()  # (F, C)
        w_up = mlp.up_proj.weight.detach().double()  # (F, C)
        w_down = mlp.down_proj.weight.detach().double()  # (C, F)
        return torch.sqrt((w_gate**2).sum(1) + (w_up**2).sum(1) + (w_down**2).sum(0))
    w_in = mlp.c_fc.weight.detach().double()  # (F, C)
    w_out = mlp.c_proj.weight.detach().double()  # (C, F)
    return torch.sqrt((w_in**2).sum(1) + (w_out**2).sum(0))


def group_rows(attn: LlamaSchemeAttention, groups: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Rows of ``q_proj`` (= columns of ``o_proj``) and rows of ``k_proj``/``v_proj`` of the
    given key/value groups (a group: ``num_heads / num_kv_heads`` query heads, one kv head)."""
    hs, rep = attn.head_size, attn.num_heads // attn.num_kv_heads
    device = attn.q_proj.weight.device
    q_rows = [torch.arange(g * rep * hs, (g + 1) * rep * hs, device=device) for g in groups]
    kv_rows = [torch.arange(g * hs, (g + 1) * hs, device=device) for g in groups]
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return (torch.cat(q_rows) if q_rows else empty, torch.cat(kv_rows) if kv_rows else empty)


def group_scores(attn: LlamaSchemeAttention) -> Tensor:
    """(num_kv_heads,) L2 norm of each key/value group's q, k, v rows and o_proj columns."""
    scores = []
    for g in range(attn.num_kv_heads):
        q_rows, kv_rows = group_rows(attn, [g])
        total = (attn.q_proj.weight.detach().double()[q_rows] ** 2).sum()
        total = total + (attn.o_proj.weight.detach().double()[:, q_rows] ** 2).sum()
        for proj in (attn.k_proj, attn.v_proj):
            total = total + (proj.weight.detach().double()[kv_rows] ** 2).sum()
        scores.append(total)
    return torch.sqrt(torch.stack(scores)) if scores else torch.zeros(0, dtype=torch.float64)


def head_rows(attn: SchemeAttention, heads: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Rows of ``c_attn`` (q, k and v parts) and columns of ``c_proj`` of the given heads."""
    hs, inner = attn.head_size, attn.inner_dim
    device = attn.c_attn.weight.device
    cols = torch.cat([torch.arange(h * hs, (h + 1) * hs, device=device) for h in heads])
    rows = torch.cat([cols + part * inner for part in range(3)])
    return rows, cols


def head_scores(attn: SchemeAttention) -> Tensor:
    """(num_heads,) L2 norm of each head's q/k/v rows and output-projection columns."""
    w_qkv = attn.c_attn.weight.detach().double()  # (3 * nh * hs, C)
    w_out = attn.c_proj.weight.detach().double()  # (C, nh * hs)
    scores = []
    for h in range(attn.num_heads):
        rows, cols = head_rows(attn, [h])
        scores.append((w_qkv[rows] ** 2).sum() + (w_out[:, cols] ** 2).sum())
    return torch.sqrt(torch.stack(scores)) if scores else torch.zeros(0, dtype=torch.float64)


def prunable_groups(module: nn.Module, section: PruningSection) -> list[tuple[str, str, nn.Module]]:
    """(kind, path, module) of every prunable group in a block: its MLPs/experts and attention."""
    groups: list[tuple[str, str, nn.Module]] = []
    for path, sub in module.named_modules():
        if section.prune_neurons and isinstance(sub, MLP | SwiGLU):
            groups.append((NEURON, path, sub))
        elif section.prune_heads and isinstance(sub, SchemeAttention | LlamaSchemeAttention):
            groups.append((HEAD, path, sub))
    return groups


def layer_candidates(
    index: int, module: nn.Module, section: PruningSection, locked: bool = False
) -> list[Candidate]:
    """Every remaining prunable structure of one layer, with its score."""
    out: list[Candidate] = []
    for kind, path, sub in prunable_groups(module, section):
        if isinstance(sub, MLP | SwiGLU):
            scores = neuron_scores(sub)
        elif isinstance(sub, LlamaSchemeAttention):
            scores = group_scores(sub)
        else:
            assert isinstance(sub, SchemeAttention)
            scores = head_scores(sub)
        out.extend(
            Candidate(float(s), index, path, i, kind, locked) for i, s in enumerate(scores.tolist())
        )
    return out


def choose_removals(
    candidates: Sequence[Candidate],
    initial: dict[str, int],
    target_sparsity: float,
    min_keep: dict[str, int],
) -> dict[tuple[int, str], list[int]]:
    """The structures to remove now: the globally smallest of each kind, down to the target.

    ``candidates`` are every remaining structure of every eligible layer; ``initial`` the count
    of each kind at initialisation. A group never drops below ``min_keep[kind]`` structures;
    locked structures (frozen layers) count as present but are never removed.
    Returns (layer, group path) -> indices to remove, ascending.
    """
    removals: dict[tuple[int, str], list[int]] = {}
    for kind, total in initial.items():
        mine = sorted(c for c in candidates if c.kind == kind)
        want_removed = math.floor(target_sparsity * total + 1e-9)
        to_remove = want_removed - (total - len(mine))
        remaining: dict[tuple[int, str], int] = {}
        for c in mine:
            remaining[(c.layer, c.group)] = remaining.get((c.layer, c.group), 0) + 1
        for c in mine:
            if to_remove <= 0:
                break
            key = (c.layer, c.group)
            if c.locked or remaining[key] <= min_keep[kind]:
                continue
            removals.setdefault(key, []).append(c.index)
            remaining[key] -= 1
            to_remove -= 1
    return {key: sorted(indices) for key, indices in removals.items()}


# --------------------------------------------------------------------------------------------
# Physical shrinking and the optimizer state that survives it
# --------------------------------------------------------------------------------------------


def _shrink_linear(linear: nn.Linear, dim: int, keep: Tensor) -> nn.Linear:
    """A new Linear keeping rows (dim 0: outputs) or columns (dim 1: inputs) ``keep``."""
    weight = linear.weight.detach().index_select(dim, keep)
    out_features, in_features = weight.shape
    new = nn.utils.skip_init(
        nn.Linear,
        in_features,
        out_features,
        bias=linear.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        new.weight.copy_(weight)
        if linear.bias is not None:
            bias = linear.bias.detach()
            new.bias.copy_(bias.index_select(0, keep) if dim == 0 else bias)
    new.requires_grad_(linear.weight.requires_grad)
    return new


Slicing = dict[str, tuple[int, Tensor]]
"""Parameter name -> (dimension, kept indices): how optimizer state rows map after a shrink."""


def shrink_mlp(mlp: MLP | SwiGLU, keep: Tensor, prefix: str) -> Slicing:
    """Keep neurons ``keep`` of ``mlp`` (in place); returns the parameter slicing."""
    if isinstance(mlp, SwiGLU):
        mlp.gate_proj = _shrink_linear(mlp.gate_proj, 0, keep)
        mlp.up_proj = _shrink_linear(mlp.up_proj, 0, keep)
        mlp.down_proj = _shrink_linear(mlp.down_proj, 1, keep)
        return {
            f"{prefix}gate_proj.weight": (0, keep),
            f"{prefix}up_proj.weight": (0, keep),
            f"{prefix}down_proj.weight": (1, keep),
        }
    mlp.c_fc = _shrink_linear(mlp.c_fc, 0, keep)
    mlp.c_proj = _shrink_linear(mlp.c_proj, 1, keep)
    return {
        f"{prefix}c_fc.weight": (0, keep),
        f"{prefix}c_fc.bias": (0, keep),
        f"{prefix}c_proj.weight": (1, keep),
    }


def shrink_attention(attn: SchemeAttention, keep_heads: Sequence[int], prefix: str) -> Slicing:
    """Keep heads ``keep_heads`` of ``attn`` (in place); returns the parameter slicing."""
    rows, cols = head_rows(attn, keep_heads)
    attn.c_attn = _shrink_linear(attn.c_attn, 0, rows)
    attn.c_proj = _shrink_linear(attn.c_proj, 1, cols)
    attn.num_heads = len(keep_heads)
    return {
        f"{prefix}c_attn.weight": (0, rows),
        f"{prefix}c_attn.bias": (0, rows),
        f"{prefix}c_proj.weight": (1, cols),
    }


def shrink_groups(attn: LlamaSchemeAttention, keep_groups: Sequence[int], prefix: str) -> Slicing:
    """Keep key/value groups ``keep_groups`` of ``attn`` (in place); returns the slicing."""
    q_rows, kv_rows = group_rows(attn, keep_groups)
    rep = attn.num_heads // attn.num_kv_heads
    attn.q_proj = _shrink_linear(attn.q_proj, 0, q_rows)
    attn.k_proj = _shrink_linear(attn.k_proj, 0, kv_rows)
    attn.v_proj = _shrink_linear(attn.v_proj, 0, kv_rows)
    attn.o_proj = _shrink_linear(attn.o_proj, 1, q_rows)
    attn.num_kv_heads = len(keep_groups)
    attn.num_heads = len(keep_groups) * rep
    return {
        f"{prefix}q_proj.weight": (0, q_rows),
        f"{prefix}k_proj.weight": (0, kv_rows),
        f"{prefix}v_proj.weight": (0, kv_rows),
        f"{prefix}o_proj.weight": (1, q_rows),
    }


def rebuild_optimizer(
    module: nn.Module,
    old: torch.optim.Optimizer,
    old_params: dict[str, nn.Parameter],
    slicing: Slicing,
    cfg: JobConfig,
) -> torch.optim.Optimizer:
    """A fresh AdamW over ``module``'s parameters holding the old state of surviving rows."""
    new = build_optimizer(module, cfg.train)
    for new_group, old_group in zip(new.param_groups, old.param_groups, strict=True):
        new_group["lr"] = old_group["lr"]
    for name, param in module.named_parameters():
        state = old.state.get(old_params[name])
        if not state:
            continue
        dim_keep = slicing.get(name)
        copied: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and dim_keep is not None and value.dim() > 0:
                copied[key] = value.index_select(dim_keep[0], dim_keep[1]).clone()
            else:
                copied[key] = value.clone() if isinstance(value, Tensor) else value
        new.state[param] = copied
    return new


def apply_removals(
    slot: Any, removals: dict[str, list[int]], section: PruningSection, cfg: JobConfig
) -> None:
    """Shrink one owned layer and replace its optimizer; ``removals``: group path -> indices."""
    module: nn.Module = slot.module
    old_params = dict(module.named_parameters())
    groups = {path: (kind, sub) for kind, path, sub in prunable_groups(module, section)}
    slicing: Slicing = {}
    for path, indices in removals.items():
        kind, sub = groups[path]
        prefix = f"{path}." if path else ""
        drop = set(indices)
        if kind == NEURON:
            assert isinstance(sub, MLP | SwiGLU)
            width = ffn_width(sub)
            device = next(sub.parameters()).device
            keep = torch.tensor([i for i in range(width) if i not in drop], device=device)
            slicing.update(shrink_mlp(sub, keep, prefix))
        elif isinstance(sub, LlamaSchemeAttention):
            kept_groups = [g for g in range(sub.num_kv_heads) if g not in drop]
            slicing.update(shrink_groups(sub, kept_groups, prefix))
        else:
            assert isinstance(sub, SchemeAttention)
            heads = [h for h in range(sub.num_heads) if h not in drop]
            slicing.update(shrink_attention(sub, heads, prefix))
    slot.optimizer = rebuild_optimizer(module, slot.optimizer, old_params, slicing, cfg)
    slot.in_arena = False  # new tensors: re-homed after the next optimizer step


def prune_step(
    cfg: JobConfig, step: int, slots: Sequence[Any], allgather: Callable[[Any], list[Any]]
) -> dict[str, Any] | None:
    """Run the pruning event of step ``step`` if the schedule has one; returns its event."""
    section = cfg.schemes.pruning
    assert section is not None
    target = sparsity_at(section, step)
    if target is None:
        return None
    eligible = set(eligible_layers(cfg))
    mine = [  # frozen layers count towards the sparsity but keep their structures
        c
        for slot in slots
        if slot.index in eligible
        for c in layer_candidates(slot.index, slot.module, section, is_frozen(slot.module))
    ]
    every = [c for part in allgather(mine) for c in part]
    initial = initial_counts(cfg)
    min_keep = {NEURON: section.min_neurons, HEAD: section.min_heads}
    if section.scope == "global":
        removals = choose_removals(every, initial, target, min_keep)
    else:  # "layer": every block to the same sparsity, its own smallest structures first
        removals = {}
        for layer in sorted(eligible):
            own = [c for c in every if c.layer == layer]
            own_initial = initial_counts(cfg, [layer])
            removals.update(choose_removals(own, own_initial, target, min_keep))
    for slot in slots:
        mine_removals = {g: idx for (layer, g), idx in removals.items() if layer == slot.index}
        if mine_removals:
            apply_removals(slot, mine_removals, section, cfg)
    removed_now = {kind: 0 for kind in initial}
    for c in every:
        if c.index in removals.get((c.layer, c.group), ()):
            removed_now[c.kind] += 1
    remaining = {
        kind: sum(1 for c in every if c.kind == kind) - removed_now[kind] for kind in initial
    }
    return {
        "kind": "prune",
        "target_sparsity": target,
        "sparsity": {kind: 1.0 - remaining[kind] / initial[kind] for kind in initial},
        "removed": removed_now,
    }


def ffn_width(mlp: MLP | SwiGLU) -> int:
    """Neurons an MLP or SwiGLU still has."""
    return mlp.up_proj.out_features if isinstance(mlp, SwiGLU) else mlp.c_fc.out_features


def layer_sparsity(module: nn.Module, cfg: JobConfig, index: int) -> dict[str, float]:
    """Fraction of a block's prunable weights removed, by kind (for reports and tests)."""
    if not isinstance(module, SchemeBlock | LlamaSchemeBlock):
        return {}
    out: dict[str, float] = {}
    attn = module.attn
    if isinstance(attn, LlamaSchemeAttention):
        out[HEAD] = 1.0 - attn.num_kv_heads / cfg.model.kv_heads
    else:
        out[HEAD] = 1.0 - attn.num_heads / cfg.model.num_heads
    mlps = [m for m in module.modules() if isinstance(m, MLP | SwiGLU)]
    d_ff = cfg.model.block_d_ff(index)
    moe = cfg.schemes.moe
    width = d_ff
    if moe is not None and isinstance(module.mlp, MoEFeedForward):
        width = moe.d_ff_expert or d_ff
    out[NEURON] = 1.0 - sum(ffn_width(m) for m in mlps) / (width * len(mlps))
    return out


def conform_to_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Shrink a freshly built layer to the shapes of a pruned layer's state dict (restore).

    Keeps the first rows; ``load_state_dict`` then overwrites every value.
    """
    for path, sub in list(module.named_modules()):
        prefix = f"{path}." if path else ""
        if isinstance(sub, SwiGLU):
            width = state[f"{prefix}up_proj.weight"].shape[0]
            if width != sub.up_proj.out_features:
                shrink_mlp(sub, torch.arange(width, device=sub.up_proj.weight.device), prefix)
        elif isinstance(sub, LlamaSchemeAttention):
            groups = state[f"{prefix}k_proj.weight"].shape[0] // sub.head_size
            if groups != sub.num_kv_heads:
                shrink_groups(sub, list(range(groups)), prefix)
        elif isinstance(sub, MLP):
            width = state[f"{prefix}c_fc.weight"].shape[0]
            if width != sub.c_fc.out_features:
                shrink_mlp(sub, torch.arange(width, device=sub.c_fc.weight.device), prefix)
        elif isinstance(sub, SchemeAttention):
            heads = state[f"{prefix}c_attn.weight"].shape[0] // (3 * sub.head_size)
            if heads != sub.num_heads:
                shrink_attention(sub, list(range(heads)), prefix)


class PruningScheme(Scheme):
    """``schemes.pruning``: structured pruning events on the schedule's steps."""

    name = "pruning"
    section_type = PruningSection
    changes_block = True

    def before_load(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        conform_to_state_dict(module, state)

    def step_end(
        self, step: int, slots: Sequence[Slot], allgather: AllGather
    ) -> dict[str, Any] | None:
        return prune_step(self.cfg, step, slots, allgather)

    def layer_stats(self, slot: Slot) -> dict[str, float]:
        out = {
            f"sparsity.{kind}": value
            for kind, value in layer_sparsity(slot.module, self.cfg, slot.index).items()
        }
        attn = getattr(slot.module, "attn", None)
        if isinstance(attn, SchemeAttention | LlamaSchemeAttention):
            out["attn.num_heads"] = float(attn.num_heads)
        return out
