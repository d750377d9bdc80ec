"""Mixture of Experts feed-forward: top-k routing, expert capacity, load-balancing loss.

Mechanism (GShard / Switch Transformer): a linear router scores each token against E experts;
each token goes to its top-k experts. An expert accepts at most
``capacity = ceil(capacity_factor * k * N / E)`` of the N tokens a microbatch brings to the block;
assignments are served in priority order, every token's first choice before any second choice,
and within a choice in token order (GShard). An assignment over capacity is either dropped (the
token's residual stream carries it past the expert) or, with ``overflow: reroute``, offered to
the token's next-ranked experts in turn until one has room. Each expert is an ordinary ``MLP``
(a ``SwiGLU`` on llama blocks) run on exactly the tokens routed to it (gathered), so the
block's compute, and the cost the profiler measures, follows the routed token counts.

With ``dispatch: padded`` every expert instead runs on as many rows as the busiest expert serves
(its own rows, then zero rows), which is what a batched (E, capacity, C) dispatch computes when
the capacity is set to the largest load (DeepSpeed-MoE with ``drop_tokens=False``); it runs as
one batched computation over the stacked experts, or expert by expert once pruning has left them
at different widths. The padding rows' outputs are discarded, so the result is the gathered one;
what changes is the work: E x the busiest expert's load, so an uneven expert load costs what it
costs under expert parallelism, where the block waits for its busiest expert.

Gates: with k = 1 the router probability of the chosen expert (Switch: it is what trains the
router); with k > 1 the chosen probabilities renormalised by the sum of the top-k probabilities
(GShard); a rerouted assignment uses its new expert's probability over the same denominator.

Load balancing: the Switch auxiliary loss ``E * sum_e f_e * P_e`` (f_e: fraction of the top-k
choices that picked e, before capacity; P_e: mean router probability of e), scaled by
``aux_loss_weight``; it is 1 when routing is uniform.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import MoESection
from dynmo_hpc.model.families.llama import SwiGLU
from dynmo_hpc.model.gpt import MLP
from dynmo_hpc.model.schemes.registry import Scheme


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens one expert accepts from ``num_tokens``: ceil(cf * k * N / E), at least 1."""
    return max(1, math.ceil(capacity_factor * top_k * num_tokens / num_experts - 1e-9))


def _positions(experts: Tensor, load: Tensor, num_experts: int) -> Tensor:
    """Queue position of each assignment at its expert, in priority order, after ``load``."""
    one_hot = F.one_hot(experts, num_experts)  # (P, E)
    before = (one_hot.cumsum(0) - one_hot).gather(1, experts[:, None]).squeeze(1)  # (P,)
    return load[experts] + before


def plan_routing(ranked: Tensor, top_k: int, capacity: int, overflow: str) -> Tensor:
    """Assign tokens to experts under a capacity; a pure function of the experts' ranking.

    ``ranked`` (N, E) int64 lists each token's experts best first. Returns ``expert`` (N, k)
    int64: the expert serving choice j of token n, or -1 where that choice was dropped.

    Example: 4 tokens that all rank expert 0 first and expert 1 second, k = 1, capacity 2:
    ``drop`` gives [[0], [0], [-1], [-1]]; ``reroute`` gives [[0], [0], [1], [1]].
    """
    num_tokens, num_experts = ranked.shape
    load = torch.zeros(num_experts, dtype=torch.long, device=ranked.device)
    choices = ranked[:, :top_k]  # (N, k)
    # Priority order: all first choices (token order), then all second choices, ...
    experts = choices.t().reshape(-1)  # (k * N,)
    accepted = _positions(experts, load, num_experts) < capacity
    load += torch.bincount(experts[accepted], minlength=num_experts)
    assignment = torch.where(accepted, experts, torch.full_like(experts, -1))
    assignment = assignment.view(top_k, num_tokens).t().contiguous()  # (N, k)
    if overflow == "drop":
        return assignment
    # Reroute: each token offers its first dropped choice to its next-ranked expert, one
    # candidate rank at a time; candidates of one token are distinct experts by construction.
    for rank in range(top_k, num_experts):
        dropped = assignment < 0  # (N, k)
        has_dropped = dropped.any(1)
        if not bool(has_dropped.any()):
            break
        tokens = has_dropped.nonzero().squeeze(1)  # (n,) in token order
        slots = dropped[tokens].int().argmax(1)  # first dropped choice of each
        candidates = ranked[tokens, rank]
        ok = _positions(candidates, load, num_experts) < capacity
        assignment[tokens[ok], slots[ok]] = candidates[ok]
        load += torch.bincount(candidates[ok], minlength=num_experts)
    return assignment


class MoEFeedForward(nn.Module):
    """E expert MLPs behind a top-k router; ``forward`` maps (N, C) -> ((N, C), aux loss).

    ``swiglu``: the experts are the llama family's SwiGLU (gate, up, down; no biases) instead of
    gpt2's GELU ``MLP``."""

    def __init__(self, d_model: int, d_ff: int, section: MoESection, swiglu: bool = False) -> None:
        super().__init__()
        self.num_experts = section.num_experts
        self.top_k = section.top_k
        self.capacity_factor = section.capacity_factor
        self.overflow = section.overflow
        self.dispatch = section.dispatch
        self.aux_loss_weight = section.aux_loss_weight
        self.router = nn.Linear(d_model, section.num_experts, bias=False)
        self.experts = nn.ModuleList(
            (SwiGLU(d_model, d_ff) if swiglu else MLP(d_model, d_ff))
            for _ in range(section.num_experts)
        )
        self.stats: dict[str, float] = {}
        """Routed, dropped and rerouted assignments and per-expert tokens since the last report."""
        self.last_tokens_per_expert: list[int] = []
        """Tokens routed to each expert in the latest forward (tests, diagnostics)."""
        self.last_rows_per_expert = 0
        """Padded dispatch: rows each expert computed in the latest forward (its busiest load)."""

    def _count(self, key: str, value: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + value

    def _batched_padded(
        self,
        x: Tensor,
        routes: list[tuple[Tensor, Tensor]],
        counts: list[int],
        rows: int,
        gates: Tensor,
    ) -> Tensor:
        """Padded dispatch as one batched computation: (E, rows, C) through stacked experts.

        Why batched rather than expert by expert: a per-expert loop adds a fixed cost per expert
        that has nothing to do with the load; the batched form is what a GShard-style dispatch
        runs, so the block's cost is that of E x rows expert rows.
        """
        num_experts, width = self.num_experts, x.shape[1]
        tokens = torch.cat([t for t, _ in routes])  # (S,) served assignments, expert by expert
        slots = torch.cat([s for _, s in routes])  # (S,)
        counts_t = torch.tensor(counts, device=x.device)
        expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts_t)
        row = torch.cat([torch.arange(n, device=x.device) for n in counts])  # (S,)
        dispatched = x.new_zeros(num_experts, rows, width).index_put((expert, row), x[tokens])
        if isinstance(self.experts[0], SwiGLU):
            gate_w = torch.stack([e.gate_proj.weight for e in self.experts])  # (E, F, C)
            up_w = torch.stack([e.up_proj.weight for e in self.experts])  # (E, F, C)
            down_w = torch.stack([e.down_proj.weight for e in self.experts])  # (E, C, F)
            gate = torch.bmm(dispatched, gate_w.transpose(1, 2))  # (E, rows, F)
            hidden = F.silu(gate) * torch.bmm(dispatched, up_w.transpose(1, 2))  # (E, rows, F)
            y = torch.bmm(hidden, down_w.transpose(1, 2))  # (E, rows, C)
        else:
            fc_w = torch.stack([e.c_fc.weight for e in self.experts])  # (E, F, C)
            fc_b = torch.stack([e.c_fc.bias for e in self.experts])  # (E, F)
            proj_w = torch.stack([e.c_proj.weight for e in self.experts])  # (E, C, F)
            proj_b = torch.stack([e.c_proj.bias for e in self.experts])  # (E, C)
            hidden = F.gelu(torch.baddbmm(fc_b[:, None], dispatched, fc_w.transpose(1, 2)))
            y = torch.baddbmm(proj_b[:, None], hidden, proj_w.transpose(1, 2))  # (E, rows, C)
        served = y[expert, row] * gates[tokens, slots, None]  # (S, C)
        return torch.zeros_like(x).index_add(0, tokens, served.to(x.dtype))  # bf16 autocast

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        num_tokens, _ = x.shape
        logits = self.router(x)  # (N, E)
        probs = F.softmax(logits, dim=-1)  # (N, E)
        ranked = probs.detach().argsort(dim=-1, descending=True, stable=True)  # (N, E)
        capacity = expert_capacity(num_tokens, self.num_experts, self.top_k, self.capacity_factor)
        assignment = plan_routing(ranked, self.top_k, capacity, self.overflow)  # (N, k)

        top_probs = probs.gather(1, ranked[:, : self.top_k])  # (N, k)
        served = assignment >= 0
        gate_probs = probs.gather(1, assignment.clamp(min=0))  # (N, k)
        if self.top_k > 1:
            gate_probs = gate_probs / top_probs.sum(-1, keepdim=True)
        gates = gate_probs * served  # (N, k)

        routes = [(assignment == e).nonzero(as_tuple=True) for e in range(self.num_experts)]
        counts = [int(tokens.numel()) for tokens, _ in routes]
        rows = max(counts) if self.dispatch == "padded" else 0
        if rows and len({tuple(next(e.parameters()).shape) for e in self.experts}) == 1:
            out = self._batched_padded(x, routes, counts, rows, gates)
        else:
            out = torch.zeros_like(x)  # (N, C)
            for expert, (tokens, slots), n in zip(self.experts, routes, counts, strict=True):
                if rows:  # padded, experts of unequal (pruned) widths: one expert at a time
                    x_e = torch.cat([x[tokens], x.new_zeros(rows - n, x.shape[1])])  # (rows, C)
                    y = expert(x_e)[:n]  # (n_e, C)
                elif n:
                    y = expert(x[tokens])  # (n_e, C)
                else:
                    continue
                out = out.index_add(0, tokens, (y * gates[tokens, slots, None]).to(out.dtype))
        self.last_tokens_per_expert = counts
        self.last_rows_per_expert = rows

        chosen = F.one_hot(ranked[:, : self.top_k], self.num_experts).sum(1)  # (N, E)
        fraction = chosen.float().mean(0) / self.top_k  # (E,)  f_e
        mean_prob = probs.mean(0)  # (E,)  P_e
        aux = self.aux_loss_weight * self.num_experts * torch.sum(fraction * mean_prob)

        num_served = int(served.sum())
        self._count("assignments", float(num_tokens * self.top_k))
        self._count("dropped", float(num_tokens * self.top_k - num_served))
        self._count("rerouted", float((served & (assignment != ranked[:, : self.top_k])).sum()))
        for e, c in enumerate(counts):
            self._count(f"expert_{e}", float(c))
        self._count("expert_rows", float(rows * self.num_experts if rows else num_served))
        return out, aux


class MoEScheme(Scheme):
    """``schemes.moe``: the selected blocks' feed-forward becomes a :class:`MoEFeedForward`."""

    name = "moe"
    section_type = MoESection
    changes_block = True
    counter_attrs = ("stats",)

    def configure_block(self, block: nn.Module, index: int) -> None:
        section: MoESection = self.section
        if section.layers is not None and index not in section.layers:
            return
        d_ff = self.cfg.model.block_d_ff(index)
        block.mlp = MoEFeedForward(
            self.cfg.model.d_model,
            section.d_ff_expert or d_ff,
            section,
            swiglu=self.cfg.model.arch == "llama",
        )
