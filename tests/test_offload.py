"""Offload logic on the CPU: bitwise-equal results, execution-order streaming, bounded residency, full coverage."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from tests.support.offload_probes import BlockProbe, MeasuredTransfer, attach_offload, units_of
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    WanVACEError,
    WanVACEInputError,
    WanVACEModelFolderError,
    decode,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
)
from wanvace_core.runtime.interleave import execution_order
from wanvace_core.runtime.offload import COMPONENTS, Offloader, SynchronousTransfer

SETTINGS = SamplerSettings(seed=9, steps=6, cfg=5.0, cfg_low_noise=4.0)


def _run(model, cache=None, with_report=False):
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task("v2v").ours))
    result = sample(model, cond, SETTINGS, cache=cache)
    frames = decode(model, to_vae_space(model, result.latents))
    return (result.latents, frames, result.cache_report) if with_report else (result.latents, frames)


@pytest.fixture(scope="module")
def reference(tiny_folder):
    return _run(load_pipeline(tiny_folder, "fp32"))


def _offloaded(tiny_folder, transfer=None, **options):
    model = load_pipeline(tiny_folder, "fp32")
    attach_offload(model, OffloadOptions(**options), transfer or SynchronousTransfer())
    return model


def _all_units(model):
    return [unit for name in COMPONENTS for unit in units_of(model.residency, name)]


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "model"},
        {"mode": "layerwise", "prefetch_blocks": 0},
        {"mode": "layerwise", "prefetch_blocks": 1},
        {"mode": "layerwise", "prefetch_blocks": 3},
    ],
)
def test_offload_modes_give_bitwise_equal_latents_and_frames(options, tiny_folder, reference):
    transfer = MeasuredTransfer()
    model = _offloaded(tiny_folder, transfer, **options)
    latents, frames = _run(model)
    assert torch.equal(latents, reference[0])
    assert torch.equal(frames, reference[1])
    assert transfer.live_bytes() > 0  # the VAE stays on the device after decoding
    released = model.residency.release_all()
    assert transfer.live_bytes() == 0  # measured: every device copy was freed
    assert released > 0 and model.residency.device_bytes() == 0


def test_model_mode_runs_one_component_at_a_time_in_pipeline_order(tiny_folder):
    transfer = MeasuredTransfer()
    model = _offloaded(tiny_folder, transfer, mode="model")
    sizes = {name: model.weight_bytes([name]) for name in COMPONENTS}
    peaks = []
    original_load = transfer.load

    def load_and_measure(unit):
        tensors = original_load(unit)
        peaks.append(transfer.live_bytes())
        return tensors

    transfer.load = load_and_measure
    _run(model)
    assert transfer.loads == ["text_encoder", "vae", "transformer", "transformer_2", "vae"]
    # Right after each copy, only that component's weights are alive on the device (each copy's storage
    # carries at most 64 alignment bytes per tensor).
    for peak, name in zip(peaks, transfer.loads, strict=True):
        assert sizes[name] <= peak <= sizes[name] + 64 * len(model.residency.units[name].host)
    assert transfer.live_bytes() >= sizes["vae"] == model.residency.device_bytes()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_layerwise_streams_blocks_in_execution_order_with_bounded_residency(prefetch, tiny_folder):
    transfer = MeasuredTransfer()
    model = _offloaded(tiny_folder, transfer, mode="layerwise", prefetch_blocks=prefetch)
    probe = BlockProbe(model, transfer)
    _run(model)
    order = execution_order(model.transformer)
    assert order[:3] == ["vace_blocks.0", "blocks.0", "blocks.1"]
    for expert in ("transformer", "transformer_2"):
        runs = probe.runs[expert]
        passes = len(runs) // len(order)
        assert passes >= 2 and runs == order * passes
        # Seen from the blocks: each runs on a device copy, bound only while it runs.
        assert max(probe.resident_when_run[expert]) == 1
        # Measured from the copies' storages: the running block plus the prefetch window, never more.
        assert max(probe.live_copies_when_run[expert]) == prefetch + 1
    probe.remove()


def test_layerwise_with_cache_skips_blocks_keeps_the_bound_and_the_result(tiny_folder):
    eager = ExpertCacheLimits(max_warmup_steps=1)
    cache = CacheOptions(residual_diff_threshold=0.2, high_noise=eager, low_noise=eager)
    expected = _run(load_pipeline(tiny_folder, "fp32"), cache=cache)
    transfer = MeasuredTransfer()
    model = _offloaded(tiny_folder, transfer, mode="layerwise", prefetch_blocks=1)
    probe = BlockProbe(model, transfer)
    latents, frames, report = _run(model, cache=cache, with_report=True)
    assert all(expert.cached_steps for expert in report.experts)
    assert torch.equal(latents, expected[0]) and torch.equal(frames, expected[1])
    for expert in ("transformer", "transformer_2"):
        assert max(probe.live_copies_when_run[expert]) <= 2
    probe.remove()


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_every_parameter_and_buffer_is_covered_exactly_once(mode, tiny_folder):
    model = _offloaded(tiny_folder, mode=mode)
    units = _all_units(model)
    params = [id(module._parameters[attr]) for unit in units for module, attr, is_param in unit.slots if is_param]
    buffers = [(id(module), attr) for unit in units for module, attr, is_param in unit.slots if not is_param]
    components = [getattr(model, name) for name in COMPONENTS]
    expected_params = {id(param) for component in components for param in component.parameters()}
    expected_buffers = {
        (id(module), attr)
        for component in components
        for module in component.modules()
        for attr, value in module._buffers.items()
        if value is not None
    }
    assert len(params) == len(set(params)), "a shared parameter would be copied twice"
    assert set(params) == expected_params
    assert set(buffers) == expected_buffers


def test_attaching_twice_does_not_stack_hooks_and_detach_restores_the_model(tiny_folder, reference):
    model = _offloaded(tiny_folder, mode="layerwise", prefetch_blocks=1)
    hooks = len(model.transformer._forward_pre_hooks), len(model.transformer.blocks[0]._forward_pre_hooks)
    attach_offload(model, OffloadOptions(mode="layerwise", prefetch_blocks=2), SynchronousTransfer())
    assert (len(model.transformer._forward_pre_hooks), len(model.transformer.blocks[0]._forward_pre_hooks)) == hooks
    assert torch.equal(_run(model)[0], reference[0])
    attach_offload(model, OffloadOptions(mode="none"))
    # Mode none keeps only its activation hook on each expert; no block hooks remain.
    assert len(model.transformer._forward_pre_hooks) == 1 and not model.transformer.blocks[0]._forward_pre_hooks
    assert torch.equal(_run(model)[0], reference[0])


def test_an_error_inside_a_block_leaves_nothing_on_the_device(tiny_folder, reference):
    model = _offloaded(tiny_folder, mode="layerwise", prefetch_blocks=1)

    class Boom(Exception):
        pass

    def explode(*_args):
        raise Boom

    handle = model.transformer.blocks[1].register_forward_pre_hook(explode)
    with pytest.raises(Boom):
        _run(model)
    handle.remove()
    assert model.residency.device_bytes() == 0
    assert all(t.data_ptr() == h.data_ptr() for unit in _all_units(model) for t, h in _bound(unit))
    assert torch.equal(_run(model)[0], reference[0])


def _bound(unit):
    """Pairs of (tensor the module uses now, the unit's host tensor)."""
    for (module, attr, is_param), host in zip(unit.slots, unit.host, strict=True):
        current = module._parameters[attr].data if is_param else module._buffers[attr]
        yield current, host


def test_a_block_list_the_offloader_does_not_know_is_refused(tiny_folder):
    model = load_pipeline(tiny_folder, "fp32")
    model.transformer.extra_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    components = {name: getattr(model, name) for name in COMPONENTS}
    with pytest.raises(WanVACEError, match="extra_blocks"):
        Offloader(components, OffloadOptions(mode="layerwise"), SynchronousTransfer())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "sequential"}, "mode='sequential'"),
        ({"prefetch_blocks": -1}, "prefetch_blocks=-1"),
        ({"max_pinned_mb": -5}, "max_pinned_mb=-5"),
    ],
)
def test_invalid_offload_options_are_refused(options, message):
    with pytest.raises(WanVACEInputError, match=message):
        OffloadOptions(**options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("mode", "prefetch"), [("model", 1), ("layerwise", 0), ("layerwise", 1), ("layerwise", 3)])
def test_cuda_offload_matches_none_and_keeps_weights_off_the_device(mode, prefetch, tiny_folder):
    on_device = load_pipeline(tiny_folder, "bf16", device="cuda")
    expected = _run(on_device)
    del on_device
    model = load_pipeline(
        tiny_folder, "bf16", device="cuda", offload=OffloadOptions(mode=mode, prefetch_blocks=prefetch)
    )
    for _ in range(2):  # the second run reuses ring slots and pinned buffers
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        latents, frames = _run(model)
        assert torch.equal(latents.cpu(), expected[0].cpu()) and torch.equal(frames, expected[1])
        assert model.residency.device_bytes() <= model.residency.planned_bytes()
    model.residency.release_all()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before  # measured by the allocator: the weights' memory is back
    assert model.residency.device_bytes() == 0
    assert all(t.data_ptr() == h.data_ptr() for unit in _all_units(model) for t, h in _bound(unit))
    model.close_residency()


def test_layerwise_follows_cache_dit_block_order_while_caching(tiny_folder):
    from wanvace_core.runtime.interleave import stock_execution_order

    never = ExpertCacheLimits(max_warmup_steps=1000)
    transfer = MeasuredTransfer()
    model = _offloaded(tiny_folder, transfer, mode="layerwise", prefetch_blocks=1)
    probe = BlockProbe(model, transfer)  # hooks the real blocks, so it sees what runs under cache-dit's wrapper
    _run(model, cache=CacheOptions(high_noise=never, low_noise=never))
    order = stock_execution_order(model.transformer)
    assert order[:3] == ["vace_blocks.0", "vace_blocks.1", "blocks.0"]
    for expert in ("transformer", "transformer_2"):
        runs = probe.runs[expert]
        assert runs == order * (len(runs) // len(order)) and runs
        assert max(probe.live_copies_when_run[expert]) <= 2
    probe.remove()
    # Back to the interleaved order once caching is off again.
    probe = BlockProbe(model)
    _run(model)
    assert probe.runs["transformer"][:3] == ["vace_blocks.0", "blocks.0", "blocks.1"]
    probe.remove()


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's memory-mapped safetensors files."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                start, end = (int(value, 16) for value in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.fixture(scope="module")
def bf16_folder(tiny_folder, tmp_path_factory):
    """The tiny pipeline with its experts stored in bf16, as the released A14B experts are."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("bf16") / "wanvace-tiny-bf16"
    shutil.copytree(tiny_folder, folder)
    for path in [*folder.glob("transformer/*.safetensors"), *folder.glob("transformer_2/*.safetensors")]:
        tensors = {key: value.to(torch.bfloat16) for key, value in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_offloaded_bf16_experts_stay_memory_mapped_in_host_memory(mode, bf16_folder):
    # The idle expert must cost page cache, not private RAM: offload keeps the loader's in-place views.
    model = load_pipeline(bf16_folder, "bf16", device="cpu")
    attach_offload(model, OffloadOptions(mode=mode, prefetch_blocks=1), SynchronousTransfer())
    _run(model)
    mappings = _file_mappings()
    for expert in ("transformer", "transformer_2"):
        units = units_of(model.residency, expert)
        host = [tensor for unit in units for tensor in unit.host if tensor.dtype == torch.bfloat16]
        assert host and all(tensor.device.type == "cpu" for tensor in host)
        outside = [t.shape for t in host if not any(start <= t.data_ptr() < end for start, end in mappings)]
        assert not outside, f"{expert}: {len(outside)} of {len(host)} bf16 weights copied into private memory"
        # Between runs every module points at those same host tensors again.
        assert all(current.data_ptr() == kept.data_ptr() for unit in units for current, kept in _bound(unit))


@pytest.mark.parametrize("options", [None, {"mode": "model"}, {"mode": "layerwise", "prefetch_blocks": 1}])
def test_released_device_memory_comes_back_at_the_next_use_with_equal_results(options, tiny_folder, reference):
    model = load_pipeline(tiny_folder, "fp32")
    if options is not None:
        attach_offload(model, OffloadOptions(**options), SynchronousTransfer())
    _run(model)
    held = model.device_bytes()
    assert held > 0
    released = model.release_device_memory()
    if options is None:
        # No host copy exists in mode none: the parameters themselves are gone until they are read back;
        # only the small computed buffers (RoPE tables) stay.
        assert all(param.is_meta for module in model.components.values() for param in module.parameters())
        assert released == held - model.device_bytes() == _parameter_bytes(model, model.components)
    else:
        assert released == held and model.device_bytes() == 0
    broker = _RecordingBroker()
    model.residency.broker = broker
    latents, frames = _run(model)
    assert torch.equal(latents, reference[0]) and torch.equal(frames, reference[1])
    if options is None:
        # Each use reads back only what it needs: the prompts were encoded before, so the text encoder
        # stays dropped.
        assert model.residency.dropped == {"text_encoder"}
        assert broker.reserved == [_parameter_bytes(model, [name]) for name in ("vae", "transformer", "transformer_2")]
        assert not any(
            param.is_meta
            for name in ("vae", "transformer", "transformer_2")
            for param in model.components[name].parameters()
        )
    else:
        # Offload re-onloads from host memory, asking for each component's room; nothing is read from disk.
        assert broker.reserved == [
            model.residency.planned_bytes(n) for n in ("vae", "transformer", "transformer_2", "vae")
        ]


class _RecordingBroker:
    def __init__(self) -> None:
        self.reserved: list[int] = []

    def reserve(self, incoming_bytes: int) -> None:
        self.reserved.append(incoming_bytes)


def test_a_failed_reload_leaves_nothing_loaded_and_the_next_one_works(tiny_folder, reference, monkeypatch):
    import wanvace_core.load.pipeline_folder as loading

    model = load_pipeline(tiny_folder, "fp32")
    model.release_device_memory()
    real_fill = loading._fill

    def fill_then_fail(module, *args):
        real_fill(module, *args)
        raise MemoryError("simulated out of memory after the first component")

    monkeypatch.setattr(loading, "_fill", fill_then_fail)
    with pytest.raises(MemoryError):
        _run(model)
    assert all(param.is_meta for module in model.components.values() for param in module.parameters())
    monkeypatch.setattr(loading, "_fill", real_fill)
    latents, frames = _run(model)
    assert torch.equal(latents, reference[0]) and torch.equal(frames, reference[1])


def test_weights_changed_on_disk_are_not_read_back_silently(tiny_folder, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_folder, folder)
    model = load_pipeline(folder, "fp32")
    model.release_device_memory()
    weights = next((folder / "vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # same bytes, new file: a replaced download
    os.utime(weights, ns=(1, 1))
    with pytest.raises(WanVACEModelFolderError, match="changed since this model was loaded"):
        model.activate("vae")


def _parameter_bytes(model, names):
    unique = {id(p): p for name in names for p in model.components[name].parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())
