"""Huge-page arenas for layer storages: recycled only when nothing uses them, and re-homing a
layer changes where its bytes live, never what they are or who refers to them."""

from __future__ import annotations

import gc
import itertools

import torch
from torch import nn

from dynmo_hpc.pipeline.migration.host_memory import (
    ALIGN_BYTES,
    LARGE_STORAGE_BYTES,
    ArenaPool,
    in_one_arena,
    layer_tensors,
    rehome,
)


def test_buffers_are_aligned_slices_of_one_arena():
    pool = ArenaPool()
    sizes = [5000, 1, 3 * ALIGN_BYTES, 70_000]
    buffers = pool.buffers(sizes)
    assert [int(b.numel()) for b in buffers] == sizes
    base = buffers[0].data_ptr()
    assert all((b.data_ptr() - base) % ALIGN_BYTES == 0 for b in buffers)
    assert all(b.data_ptr() > a.data_ptr() for a, b in itertools.pairwise(buffers))
    assert all(b.dtype == torch.uint8 and b.device.type == "cpu" for b in buffers)


def test_an_arena_is_reused_only_once_every_buffer_of_it_is_gone():
    pool = ArenaPool()
    first = pool.buffers([1 << 20, 1 << 20])
    first[0].fill_(7)
    address = first[0].data_ptr()
    survivor = first[1]
    del first
    gc.collect()
    assert pool.free_bytes() == 0, "one buffer is still alive: its arena must stay in use"
    survivor.fill_(9)
    other = pool.buffers([1 << 20, 1 << 20])
    assert other[0].data_ptr() != address and pool.reused == 0
    assert bool((survivor == 9).all()), "a live buffer must never be handed out again"
    del survivor
    gc.collect()
    assert pool.free_bytes() >= 2 << 20
    again = pool.buffers([1 << 20, 1 << 20])
    assert again[0].data_ptr() == address and pool.reused == 1


def test_a_tensor_built_over_a_buffer_keeps_the_arena_in_use():
    """The receiver rebuilds tensors over the buffers (views of their storages): as long as any
    such tensor lives, the arena is not free, even when the buffer tensors themselves are gone."""
    pool = ArenaPool()
    buffers = pool.buffers([4096 * 4])
    weight = torch.empty(0, dtype=torch.float32).set_(buffers[0].untyped_storage(), 0, (4096,))
    weight.fill_(1.5)
    del buffers
    gc.collect()
    assert pool.free_bytes() == 0
    pool.buffers([4096 * 4])  # must not reuse the memory under `weight`
    assert bool((weight == 1.5).all())
    del weight
    gc.collect()
    assert pool.free_bytes() > 0


def test_small_requests_do_not_pin_large_arenas_and_the_free_list_is_bounded():
    pool = ArenaPool(max_free_arenas=2)
    for size in (8 << 20, 4 << 20, 2 << 20):
        pool.buffers([size])  # dropped at once
    gc.collect()
    assert pool.free_bytes() == (4 << 20) + (2 << 20), "only the two newest arenas are kept"
    pool.buffers([1 << 20])  # 2 MiB is more than 1.25x of 1 MiB: fresh memory
    assert pool.reused == 0
    pool.buffers([2 << 20])
    assert pool.reused == 1


def test_fresh_takes_new_memory_but_still_keeps_what_is_released():
    pool = ArenaPool()
    pool.buffers([1 << 20])
    gc.collect()
    assert pool.free_bytes() == 1 << 20
    with pool.fresh():
        pool.buffers([1 << 20])  # fresh memory, released at once
        gc.collect()
        assert pool.reused == 0 and pool.free_bytes() == 2 << 20
    pool.buffers([1 << 20])
    assert pool.reused == 1, "after the block the pool recycles again"


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.register_buffer("mask", torch.ones(256, 256))
        self.register_buffer("scratch", torch.zeros(300, 300), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) * 1.0)


def test_rehome_keeps_values_identities_and_sharing():
    torch.manual_seed(0)
    layer = _Layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    layer.tied = layer.fc.weight[:128]  # a view sharing the weight's storage
    tensors = layer_tensors(layer, optimizer)
    before = {id(t): t.detach().clone() for t in tensors}
    identities = [id(t) for t in tensors]
    large = [t for t in tensors if t.untyped_storage().nbytes() > LARGE_STORAGE_BYTES]
    assert len(large) >= 5  # weight, its two moments, the mask, the scratch buffer

    pool = ArenaPool()
    assert not in_one_arena(tensors, pool)
    moved_bytes = rehome(tensors, pool)

    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in large}
    assert moved_bytes == sum(unique.values())
    assert [id(t) for t in layer_tensors(layer, optimizer)] == identities
    for t in tensors:
        assert torch.equal(t, before[id(t)]), "rehome must not change a single value"
    assert in_one_arena(tensors, pool)
    assert layer.tied.untyped_storage().data_ptr() == layer.fc.weight.untyped_storage().data_ptr()
    layer.fc.weight.data[0, 0] = 42.0  # the view still sees the weight's memory
    assert layer.tied[0, 0].item() == 42.0
    # Small storages (bias, norm) stay where torch put them.
    assert layer.fc.bias.untyped_storage().nbytes() <= LARGE_STORAGE_BYTES


def test_a_rehomed_layer_trains_exactly_like_one_that_was_not():
    def run(move: bool) -> list[float]:
        torch.manual_seed(1)
        layer = _Layer()
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        data = torch.randn(6, 8, 256)
        losses = []
        for step, x in enumerate(data):
            loss = layer(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if move and step == 1:
                rehome(layer_tensors(layer, optimizer), ArenaPool())
            losses.append(loss.item())
        return losses

    assert run(move=True) == run(move=False)


def test_rehome_of_nothing_large_is_a_no_op():
    small = [torch.zeros(10), torch.ones(3, dtype=torch.int64)]
    pointers = [t.data_ptr() for t in small]
    assert rehome(small, ArenaPool()) == 0
    assert [t.data_ptr() for t in small] == pointers
