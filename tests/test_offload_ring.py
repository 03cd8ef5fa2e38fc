"""The CUDA layerwise ring (`RingTransfer`) driven on the CPU through simulated streams.

The same ring code runs on a GPU with `CudaStreamOps`; here `SimulatedStreamOps` runs side-stream
copies as late as CUDA may, poisons fresh buffers, and raises on the ordering hazards that an eager
CPU cannot show as wrong numbers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.support.offload_probes import attach_offload
from tests.support.simulated_streams import ForgetsHostSync, ForgetsStreamWaits, SimulatedStreamOps, StreamHazard
from tests.test_offload import _run
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    OffloadOptions,
    WanVACEError,
    WanVACEInputError,
    load_pipeline,
)
from wanvace_core.runtime.transfer import RingTransfer, Unit, ring_transfer


@pytest.fixture(scope="module")
def reference(tiny_folder):
    return _run(load_pipeline(tiny_folder, "fp32"))


def _observed_run(model, ops, **kwargs):
    with ops.observing_compute():
        return _run(model, **kwargs)


def _ring_model(tiny_folder, ops, **options):
    model = load_pipeline(tiny_folder, "fp32")
    attach_offload(model, OffloadOptions(mode="layerwise", **options), stream_ops=ops)
    assert isinstance(model.residency.transfer, RingTransfer)
    model.offload_events = []
    model.residency.observers.append(model.offload_events.append)
    return model


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_ring_results_are_bitwise_equal_and_device_memory_is_the_ring(prefetch, tiny_folder, reference):
    ops = SimulatedStreamOps()
    model = _ring_model(tiny_folder, ops, prefetch_blocks=prefetch)
    ring = model.residency.transfer
    latents, frames = _observed_run(model, ops)
    assert torch.equal(latents, reference[0]) and torch.equal(frames, reference[1])
    assert ring.capacity == prefetch + 1
    assert ops.copies_run > 0
    # Streaming every block of every pass allocated no more than the slots, however long the run.
    assert ops.peak_device_bytes == ring.capacity * ring.slot_bytes
    blocks = [unit for streamer in model.residency.streamers.values() for unit in streamer.units.values()]
    assert ring.slot_bytes == max(unit.staged_nbytes for unit in blocks)
    assert sum(buffer.numel() for buffer in ring.pinned) == ring.capacity * ring.slot_bytes
    for event in model.offload_events:
        for expert in ("transformer", "transformer_2"):
            assert len([name for name in event.resident if name.startswith(expert + ".")]) <= prefetch + 1


def test_ring_gives_its_device_slots_back_on_release_and_reallocates_on_the_next_run(tiny_folder, reference):
    ops = SimulatedStreamOps()
    model = _ring_model(tiny_folder, ops, prefetch_blocks=1)
    _observed_run(model, ops)
    model.residency.release_all()
    assert model.residency.device_bytes() == 0 and model.residency.transfer.device_slots is None
    assert ops.pending() == 0
    latents, frames = _observed_run(model, ops)
    assert torch.equal(latents, reference[0]) and torch.equal(frames, reference[1])


def test_ring_with_cache_skips_releases_unused_prefetches_safely(tiny_folder):
    eager = ExpertCacheLimits(max_warmup_steps=1)
    cache = CacheOptions(residual_diff_threshold=0.2, high_noise=eager, low_noise=eager)
    expected = _run(load_pipeline(tiny_folder, "fp32"), cache=cache)
    ops = SimulatedStreamOps()
    model = _ring_model(tiny_folder, ops, prefetch_blocks=2)
    latents, frames, report = _observed_run(model, ops, cache=cache, with_report=True)
    assert all(expert.cached_steps for expert in report.experts)
    assert torch.equal(latents, expected[0]) and torch.equal(frames, expected[1])
    model.residency.release_all()
    assert ops.pending() == 0  # skipped prefetches' copies were waited for before their slots went back


def test_a_ring_smaller_than_the_prefetch_window_prefetches_less(tiny_folder, reference):
    model = _ring_model(tiny_folder, SimulatedStreamOps(), prefetch_blocks=0)  # sizes the slots for this model
    ops = SimulatedStreamOps()
    ring = RingTransfer(ops, slots=2, slot_bytes=model.residency.transfer.slot_bytes)
    attach_offload(model, OffloadOptions(mode="layerwise", prefetch_blocks=3), ring)
    model.offload_events = []
    model.residency.observers.append(model.offload_events.append)
    assert model.residency.prefetch_blocks == 1
    latents, frames = _observed_run(model, ops)
    assert torch.equal(latents, reference[0]) and torch.equal(frames, reference[1])
    assert max(len(event.resident) for event in model.offload_events) <= 3  # expert's own weights + 2 blocks


@pytest.mark.parametrize("ops_class", [ForgetsStreamWaits, ForgetsHostSync])
def test_the_simulation_catches_a_ring_that_skips_an_ordering_step(ops_class, tiny_folder):
    ops = ops_class()
    model = _ring_model(tiny_folder, ops, prefetch_blocks=1)
    with pytest.raises(StreamHazard):
        _observed_run(model, ops)
    # The deliberately broken ops make closing hazardous too: close here, not in a finalizer later.
    with contextlib.suppress(StreamHazard):
        model.close_residency()


class _Holder(torch.nn.Module):
    def __init__(self, megabytes: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(int(megabytes * 2**20) // 4), requires_grad=False)


def _unit(name: str, megabytes: float) -> Unit:
    return Unit.of_module(name, _Holder(megabytes))


def test_ring_size_follows_prefetch_and_the_pinned_cap():
    blocks = [_unit("a", 1.5), _unit("b", 1.0)]
    ops = SimulatedStreamOps()
    assert ring_transfer(ops, blocks, prefetch_blocks=3, max_pinned_mb=0).capacity == 4
    capped = ring_transfer(ops, blocks, prefetch_blocks=3, max_pinned_mb=4)
    assert capped.capacity == 2 and capped.slot_bytes == blocks[0].staged_nbytes
    assert ring_transfer(ops, blocks, prefetch_blocks=1, max_pinned_mb=100).capacity == 2
    with pytest.raises(WanVACEInputError, match="max_pinned_mb=1 "):
        ring_transfer(ops, blocks, prefetch_blocks=1, max_pinned_mb=1)


def test_ring_reuses_whichever_slot_is_free_and_refuses_to_overrun():
    ops = SimulatedStreamOps()
    units = [_unit(name, 0.25) for name in "abcd"]
    for index, unit in enumerate(units):
        unit.host[0].fill_(index + 1)
    ring = RingTransfer(ops, slots=2, slot_bytes=units[0].staged_nbytes)
    first, second = ring.begin(units[0]), ring.begin(units[1])
    assert torch.all(ring.finish(units[1], second)[0] == 2)
    ring.release(units[1], second)  # out of order: the second slot frees first
    third = ring.begin(units[2])
    assert third.slot == second.slot
    with pytest.raises(WanVACEError, match="overrun"):
        ring.begin(units[3])
    assert torch.all(ring.finish(units[0], first)[0] == 1)
    assert torch.all(ring.finish(units[2], third)[0] == 3)
    for unit, handle in ((units[0], first), (units[2], third)):
        ring.release(unit, handle)
    ring.close()
    assert ops.pending() == 0


def test_dropping_the_model_gives_its_pinned_buffers_back(tiny_folder):
    import gc

    ops = SimulatedStreamOps()
    freed: list[int] = []
    unlock = ops.free_host_buffer
    ops.free_host_buffer = lambda buffer: (freed.append(buffer.numel()), unlock(buffer))
    model = _ring_model(tiny_folder, ops, prefetch_blocks=1)
    _observed_run(model, ops)
    pinned = sum(buffer.numel() for buffer in model.residency.transfer.pinned)
    assert pinned > 0 and not freed
    del model
    gc.collect()
    assert sum(freed) == pinned  # the finalizer closed the ring without anyone calling close()
