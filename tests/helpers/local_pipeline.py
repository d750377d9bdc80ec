"""Shared scheme checks, and an in-process pipeline the per-scheme tests compare with.

``train_local_pipeline`` drives the real :class:`~dynmo_hpc.pipeline.stage.PipelineStage` objects
of a partition in one process: payloads and gradients pass between stages through a mailbox that
copies exactly the ``activation_spec`` tensors (what MPI would carry), every layer boundary is cut
as in a real run, and each stage's :class:`SchemeController` runs in its own thread with a real
allgather (a barrier), so collective decisions are made the multi-rank way. It is the fast
("manual pipeline") counterpart of the MPI parity test in ``test_schemes_parity.py``.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.optim import clip_coefficient, lr_at, squared_grad_norm
from dynmo_hpc.model.schemes import SchemeController
from dynmo_hpc.pipeline.data import TextDataset
from dynmo_hpc.pipeline.stage import LayerSlot, PipelineStage, StepStats
from tests.helpers.jobs import ROOT, TINY

# Per scheme: overrides on the TINY model that make the mechanism act within a few steps.
SCHEME_OVERRIDES: dict[str, list[str]] = {
    "moe": ["schemes.moe.capacity_factor=1.0", "schemes.moe.overflow=reroute"],
    "pruning": [
        "schemes.pruning.start_step=0",
        "schemes.pruning.end_step=3",
        "schemes.pruning.interval_steps=1",
        "schemes.pruning.final_sparsity=0.5",
    ],
    "freezing": [
        "schemes.freezing.threshold=1000.0",
        "schemes.freezing.interval_steps=1",
        "schemes.freezing.start_step=1",
        "schemes.freezing.max_layers_per_check=1",
    ],
    "sparse_attention": [
        "schemes.sparse_attention.block_size=8",
        "schemes.sparse_attention.layer_density=[0.5,1.0,0.25,0.75]",
        "schemes.sparse_attention.drift_factor=0.5",
        "schemes.sparse_attention.drift_end_step=4",
    ],
    "early_exit": ["schemes.early_exit.threshold=0.0058", "schemes.early_exit.layers=[1,2,3]"],
    "mod": ["schemes.mod.layers=[1,2,4]", "schemes.mod.layer_capacity=[0.5,0.25,0.75]"],
}


def scheme_config(tmp_path: Path, scheme: str | None, *overrides: str) -> config_mod.JobConfig:
    """The TINY job with one scheme switched on (None: no scheme)."""
    extra = SCHEME_OVERRIDES[scheme] if scheme else []
    return config_mod.load(
        ROOT / "jobs/default.yaml",
        [*TINY, f"job.out_dir={tmp_path}", f"job.name={scheme or 'plain'}", *extra, *overrides],
    )


class _Mailbox:
    def __init__(self) -> None:
        self.items: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}


class LocalLink:
    """A StageLink stand-in that hands payloads to the neighbour stage in the same process."""

    def __init__(self, mailbox: _Mailbox, stage: int, num_stages: int) -> None:
        self.mailbox, self.stage, self.num_stages = mailbox, stage, num_stages
        self.idle_s = 0.0
        self.num_pending_sends = 0

    @staticmethod
    def _copy(payload: dict[str, torch.Tensor], spec: Any) -> dict[str, torch.Tensor]:
        return {name: payload[name].detach().to(dtype).clone() for name, (_, dtype) in spec.items()}

    def recv_forward(self, mb: int, spec: Any) -> dict[str, torch.Tensor] | None:
        return None if self.stage == 0 else self.mailbox.items.pop(("F", self.stage, mb))

    def send_forward(self, mb: int, spec: Any, payload: dict[str, torch.Tensor]) -> None:
        if self.stage < self.num_stages - 1:
            self.mailbox.items[("F", self.stage + 1, mb)] = self._copy(payload, spec)

    def recv_backward(self, mb: int, spec: Any) -> dict[str, torch.Tensor] | None:
        last = self.stage == self.num_stages - 1
        return None if last else self.mailbox.items.pop(("B", self.stage, mb))

    def send_backward(self, mb: int, spec: Any, grads: dict[str, torch.Tensor]) -> None:
        if self.stage > 0:
            self.mailbox.items[("B", self.stage - 1, mb)] = self._copy(grads, spec)

    def reap_sends(self) -> None:
        pass

    def finish_sends(self) -> None:
        pass


class ThreadAllgather:
    """``allgather`` for N threads: each gives an object and gets everyone's, in rank order."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks)
        self.values: list[Any] = [None] * num_ranks

    def __call__(self, rank: int, obj: Any) -> list[Any]:
        self.values[rank] = obj
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()
        return out


@dataclass
class LocalRun:
    losses: list[float] = field(default_factory=list)
    stages: list[PipelineStage] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    backward_s: list[dict[int, float]] = field(default_factory=list)
    """Per step: backward cost of every layer (0.0 = its backward never ran)."""


def migrate(stages: list[PipelineStage], cfg: config_mod.JobConfig, new_parts: list[int]) -> None:
    """Move layers to match ``new_parts`` the way migration does: pickle the whole module with
    ``torch.save``, rebuild its AdamW on the receiver and load the optimizer's state dict."""
    owned = {slot.index: slot for stage in stages for slot in stage.slots}
    arrivals: list[list[LayerSlot]] = []
    for s, stage in enumerate(stages):
        arrived = []
        for index in range(new_parts[s], new_parts[s + 1]):
            if index in stage.layer_indices:
                continue
            old = owned[index]
            buffer = io.BytesIO()
            torch.save(old.module, buffer)
            buffer.seek(0)
            module = torch.load(buffer, weights_only=False)
            slot = stage.make_slot(index, module)
            slot.optimizer.load_state_dict(old.optimizer.state_dict())
            arrived.append(slot)
        arrivals.append(arrived)
    for s, (stage, arrived) in enumerate(zip(stages, arrivals, strict=True)):
        keep = set(range(new_parts[s], new_parts[s + 1]))
        leaving = {i for i in stage.layer_indices if i not in keep}
        stage.replace_layers(new_parts, arrived=arrived, leaving=leaving)


def train_local_pipeline(
    cfg: config_mod.JobConfig,
    parts: list[int],
    steps: int,
    repartition: dict[int, list[int]] | None = None,
) -> LocalRun:
    """GPipe-order training of ``parts`` through the real engine, in one process.

    ``repartition`` maps a step to the partition that layers migrate to after that step.
    """
    torch.set_num_threads(1)
    num_stages = len(parts) - 1
    dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
    mailbox = _Mailbox()
    device = torch.device("cpu")
    run = LocalRun()
    run.stages = [
        PipelineStage(cfg, s, parts, LocalLink(mailbox, s, num_stages), dataset, device)  # type: ignore[arg-type]
        for s in range(num_stages)
    ]
    controllers = [SchemeController(cfg) for _ in run.stages]
    gather = ThreadAllgather(num_stages)
    for step in range(steps):
        stats = [StepStats() for _ in run.stages]
        for stage in run.stages:
            stage.reset_timers()
        saved = [
            [
                stage.forward_microbatch(step, mb, stats[s])
                for mb in range(cfg.train.num_microbatches)
            ]
            for s, stage in enumerate(run.stages)
        ]
        for s in reversed(range(num_stages)):
            for mb in range(cfg.train.num_microbatches):
                run.stages[s].backward_microbatch(mb, saved[s][mb], stats[s])
        slots = sorted((sl for st in run.stages for sl in st.slots), key=lambda sl: sl.index)
        coeff = clip_coefficient(
            [squared_grad_norm(sl.module) for sl in slots], cfg.train.grad_clip
        )
        for stage in run.stages:
            stage.optimizer_step(lr_at(step, cfg.train), coeff)
        results: list[list[dict[str, Any]]] = [[] for _ in run.stages]

        def end(rank: int, step: int = step, results: list[Any] = results) -> None:
            results[rank] = controllers[rank].step_end(
                step, run.stages[rank].slots, lambda obj: gather(rank, obj)
            )

        threads = [threading.Thread(target=end, args=(r,)) for r in range(num_stages)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for stage, controller in zip(run.stages, controllers, strict=True):
            stage.no_grad_below = controller.no_grad_below
        if repartition and step in repartition:
            migrate(run.stages, cfg, repartition[step])
        run.events.extend(results[0])
        run.losses.append(stats[-1].lm_loss_sum)
        run.backward_s.append(
            {sl.index: sl.backward_timer.seconds() for st in run.stages for sl in st.slots}
        )
    return run
