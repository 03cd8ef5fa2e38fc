"""Tiled VAE decode and encode (diffusers' AutoencoderKLWan tiling) on the tiny model.

Every tiled comparison counts the decoder's or encoder's forward calls, so tiling that silently stayed off
(diffusers runs untiled when a frame fits one tile) fails the test. Measured on CPU, fp32, 64x64 frames
split into 2x2 tiles of 48 px overlapping 16 px, PSNR against the untiled result: decode 39.3 dB (current
set) and 32.9 dB (oldest set; the tiny weights differ) on frames in [0, 1]; the control-clip encode of a
smooth clip 35.3 / 35.6 dB of the untiled latents' range (max difference 0.18 / 0.28 in a range of 1.9 / 2.0).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest
import torch

from wanvace_core import WanVACEInputError, decode, to_vae_space
from wanvace_core.generation.tiling import VAETiling, vae_tiling

SIZE = 64  # pixels; 8x8 latent pixels
LATENT_FRAMES = 2
TILES = VAETiling(mode="on", tile_size=48, overlap=16)  # latent tiles of 6 every 4: 2 x 2 tiles
TILE_COUNT = 4
DECODE_MIN_PSNR = 28.0
ENCODE_MIN_PSNR = 28.0
STATE = (
    "use_tiling",
    "tile_sample_min_height",
    "tile_sample_min_width",
    "tile_sample_stride_height",
    "tile_sample_stride_width",
)


@pytest.fixture(scope="module")
def model(loaded_models):
    return loaded_models("fp32")


@pytest.fixture(scope="module")
def latents(model):
    generator = torch.Generator().manual_seed(0)
    return to_vae_space(model, torch.randn(1, 16, LATENT_FRAMES, SIZE // 8, SIZE // 8, generator=generator))


@pytest.fixture(scope="module")
def untiled_frames(model, latents):
    return decode(model, latents)


@contextmanager
def counting(module):
    """Counts `module`'s forward calls inside the block."""
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(None))
    try:
        yield calls
    finally:
        handle.remove()


def psnr(reference: torch.Tensor, other: torch.Tensor, peak: float) -> float:
    return float(10 * torch.log10(peak**2 / ((reference - other) ** 2).mean()))


def vae_state(vae) -> dict:
    return {name: getattr(vae, name) for name in STATE}


def reference_decode(model, latents):
    """WanVACEDecode's decode as it was before tiling existed."""
    with torch.no_grad():
        video = model.vae.decode(latents.to(model.device, model.vae.dtype), return_dict=False)[0]
        frames = model.helper.video_processor.postprocess_video(video, output_type="pt")
    return frames.flatten(0, 1).permute(0, 2, 3, 1).float().cpu()


@pytest.mark.slow
def test_tiled_decode_is_close_to_untiled(model, latents, untiled_frames):
    before = vae_state(model.vae)
    with counting(model.vae.decoder) as calls:
        tiled = decode(model, latents, TILES)
    assert len(calls) == TILE_COUNT * LATENT_FRAMES  # one decoder call per tile and latent frame
    assert tiled.shape == untiled_frames.shape
    assert not torch.equal(tiled, untiled_frames)
    assert psnr(untiled_frames, tiled, 1.0) >= DECODE_MIN_PSNR
    assert vae_state(model.vae) == before


@pytest.mark.slow
def test_tiled_encode_is_close_to_untiled(model):
    """The control-video encode as prepare_conditioning runs it: WanVACEPipeline.prepare_video_latents."""
    generator = torch.Generator().manual_seed(1)
    frames = 1 + 4 * (LATENT_FRAMES - 1)
    # A smooth clip, as real frames are: random 8x8 colours, upsampled.
    coarse = torch.rand(1, 3, frames, 8, 8, generator=generator) * 2 - 1
    video = torch.nn.functional.interpolate(coarse, size=(frames, SIZE, SIZE), mode="trilinear")
    mask = torch.zeros(1, 1, frames, SIZE, SIZE)
    mask[..., SIZE // 4 :, :] = 1.0

    def encode(tiling):
        with counting(model.vae.encoder) as calls, torch.no_grad():
            with vae_tiling(model, tiling, frames, SIZE, SIZE, None, encode=True) as tiled:
                latents = model.helper.prepare_video_latents(video, mask, [[]], None, model.device)
        return latents, len(calls), tiled

    untiled, untiled_calls, was_tiled = encode(None)
    assert not was_tiled
    tiled, tiled_calls, was_tiled = encode(TILES)
    assert was_tiled
    # Two encodes (inactive, reactive), each one call for the first frame and one per 4-frame chunk, per tile.
    assert untiled_calls == 2 * LATENT_FRAMES
    assert tiled_calls == TILE_COUNT * untiled_calls
    assert tiled.shape == untiled.shape
    peak = float(untiled.max() - untiled.min())
    assert psnr(untiled, tiled, peak) >= ENCODE_MIN_PSNR


@pytest.mark.slow
def test_prepare_conditioning_tiles_the_control_video_encode(model):
    from tests.support.vace_tasks import NEGATIVE, PROMPT
    from wanvace_core import VACEInputs, prepare_conditioning

    frames = 1 + 4 * (LATENT_FRAMES - 1)
    coarse = torch.rand(frames, 8, 8, 3, generator=torch.Generator().manual_seed(2))
    control = torch.nn.functional.interpolate(coarse.permute(3, 0, 1, 2)[None], size=(frames, SIZE, SIZE))
    inputs = VACEInputs(PROMPT, NEGATIVE, SIZE, SIZE, frames, control_video=control[0].permute(1, 2, 3, 0))

    def conditioning_latents(tiling):
        with counting(model.vae.encoder) as calls:
            cond = prepare_conditioning(model, inputs, tiling)
        return cond.conditioning_latents, len(calls)

    untiled, untiled_calls = conditioning_latents(None)
    assert torch.equal(conditioning_latents(VAETiling(mode="off"))[0], untiled)
    tiled, tiled_calls = conditioning_latents(TILES)
    assert tiled_calls == TILE_COUNT * untiled_calls
    peak = float(untiled.max() - untiled.min())
    assert psnr(untiled.float(), tiled.float(), peak) >= ENCODE_MIN_PSNR


def test_off_and_none_are_bitwise_todays_decode(model, latents, untiled_frames):
    expected = reference_decode(model, latents)
    assert torch.equal(untiled_frames, expected)  # tiling None
    with counting(model.vae.decoder) as calls:
        off = decode(model, latents, VAETiling(mode="off"), free_bytes=1)
    assert torch.equal(off, expected)
    assert len(calls) == LATENT_FRAMES


def test_off_overrides_tiling_the_vae_had_and_restores_it(model, latents, untiled_frames):
    vae = model.vae
    vae.enable_tiling(32, 40, 16, 24)
    try:
        enabled = vae_state(vae)
        with vae_tiling(model, VAETiling(mode="off"), LATENT_FRAMES, SIZE, SIZE, None, encode=False) as tiled:
            assert not tiled
            assert vae.use_tiling is False
        assert vae_state(vae) == enabled
    finally:
        vae.disable_tiling()


@pytest.mark.slow
def test_auto_tiles_only_when_the_untiled_estimate_does_not_fit(model, latents, untiled_frames, caplog):
    caplog.set_level(logging.INFO, logger="wanvace_core.generation.tiling")
    auto = VAETiling(mode="auto", tile_size=TILES.tile_size, overlap=TILES.overlap)
    with counting(model.vae.decoder) as calls:
        plenty = decode(model, latents, auto, free_bytes=2**50)
    assert len(calls) == LATENT_FRAMES
    assert torch.equal(plenty, untiled_frames)
    assert "untiled (tiled=auto; needs" in caplog.text
    with counting(model.vae.decoder) as calls:
        unknown = decode(model, latents, auto, free_bytes=None)
    assert len(calls) == LATENT_FRAMES
    assert torch.equal(unknown, untiled_frames)
    assert "free device memory unknown" in caplog.text
    caplog.clear()
    with counting(model.vae.decoder) as calls:
        scarce = decode(model, latents, auto, free_bytes=1)
    assert len(calls) == TILE_COUNT * LATENT_FRAMES
    assert psnr(untiled_frames, scarce, 1.0) >= DECODE_MIN_PSNR
    # Even the tiled estimate exceeds 1 byte: the log says so.
    assert "it may still run out of memory" in caplog.text


def test_auto_decides_at_the_untiled_estimate(model):
    from wanvace_core.generation.tiling import untiled_peak_bytes

    auto = VAETiling(mode="auto")
    for encode, frames in ((False, 21), (True, 81)):
        needed = untiled_peak_bytes(model, frames, 720, 1280, encode=encode)
        with vae_tiling(model, auto, frames, 720, 1280, needed, encode=encode) as tiled:
            assert not tiled
        with vae_tiling(model, auto, frames, 720, 1280, needed - 1, encode=encode) as tiled:
            assert tiled
            assert model.vae.use_tiling
        assert not model.vae.use_tiling


def test_tiled_estimate_is_below_untiled_at_720p(model):
    from wanvace_core.generation.tiling import tiled_peak_bytes, untiled_peak_bytes

    tiling = VAETiling(mode="on")
    for encode, frames in ((False, 21), (True, 81)):
        untiled = untiled_peak_bytes(model, frames, 720, 1280, encode=encode)
        assert tiled_peak_bytes(model, tiling, frames, 720, 1280, encode=encode) < untiled
        # A frame that fits one tile runs untiled in diffusers: the same estimate.
        small = untiled_peak_bytes(model, frames, 256, 256, encode=encode)
        assert tiled_peak_bytes(model, tiling, frames, 256, 256, encode=encode) == small


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"mode": "yes"}, "tiled='yes'"),
        ({"tile_size": 250}, "tile_size=250"),
        ({"tile_size": 8, "overlap": 0}, "tile_size=8"),
        ({"tile_size": 256.0}, "tile_size=256.0"),
        ({"overlap": 60}, "tile_overlap=60"),
        ({"overlap": 256}, "tile_overlap=256"),
        ({"overlap": -8}, "tile_overlap=-8"),
        ({"overlap": True}, "tile_overlap=True"),
    ],
)
def test_invalid_options_are_refused_naming_the_input(options, named):
    with pytest.raises(WanVACEInputError) as refused:
        VAETiling(**options)
    message = str(refused.value)
    assert named in message
    assert "use" in message or "choose" in message


def test_vae_state_is_restored_after_an_error(model):
    vae = model.vae
    before = vae_state(vae)
    with pytest.raises(RuntimeError, match="inside"):
        with vae_tiling(model, TILES, LATENT_FRAMES, SIZE, SIZE, None, encode=False) as tiled:
            assert tiled
            assert vae_state(vae) == {
                "use_tiling": True,
                "tile_sample_min_height": 48,
                "tile_sample_min_width": 48,
                "tile_sample_stride_height": 32,
                "tile_sample_stride_width": 32,
            }
            raise RuntimeError("inside")
    assert vae_state(vae) == before


# --- WanVACEDecode in ComfyUI (a subprocess inside the ComfyUI tree) -------------------------------------

_NODE_SCRIPT = r"""
import importlib.util, json, os, sys, types
sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository's own `nodes` package
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options

comfy.options.enable_args_parsing()
import torch

repo, folder = os.environ["WANVACE_REPO"], os.environ["WANVACE_TINY"]
torch.set_num_threads(2)
spec = importlib.util.spec_from_file_location("wanvace_pack", os.path.join(repo, "__init__.py"),
                                              submodule_search_locations=[repo])
sys.modules["wanvace_pack"] = importlib.util.module_from_spec(spec)
# Only the decode node's modules: the package's nodes/__init__ imports every node.
nodes_package = types.ModuleType("wanvace_pack.nodes")
nodes_package.__path__ = [os.path.join(repo, "nodes")]
sys.modules["wanvace_pack.nodes"] = nodes_package
from wanvace_pack.nodes.decode import WanVACEDecode
from wanvace_pack.nodes.tiling import free_device_bytes, tiling_inputs
from wanvace_pack.wanvace_core import decode, load_pipeline, to_vae_space

schema = WanVACEDecode.define_schema()
inputs = {item.id: item for item in schema.inputs}
model = load_pipeline(folder, "fp32")
latents = to_vae_space(model, torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0)))
old_prompt = WanVACEDecode.execute(model, {"samples": latents}).result[0]  # saved before the tiling inputs
print(json.dumps({
    "tiling": {name: [inputs[name].optional, inputs[name].default, bool(inputs[name].tooltip)]
               for name in ("tiled", "tile_size", "tile_overlap")},
    "required_tooltips": all(item.tooltip for item in schema.inputs),
    "prefixed": [item.id for item in tiling_inputs("control_")],
    "valid": WanVACEDecode.validate_inputs(),
    "refused": WanVACEDecode.validate_inputs(tile_size=250),
    "refused_overlap": WanVACEDecode.validate_inputs(tile_size=128, tile_overlap=128),
    "free_bytes": free_device_bytes(model),
    "old_prompt_bitwise": bool(torch.equal(old_prompt, decode(model, latents))),
    "off_bitwise": bool(torch.equal(WanVACEDecode.execute(model, {"samples": latents}, "off").result[0], old_prompt)),
}))
"""


@pytest.mark.slow
def test_decode_node_in_comfyui(tiny_folder):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from scripts.comfy_server import DEFAULT_COMFY_DIR
    from tests.support.comfyui import COMFY_SKIPPED

    if COMFY_SKIPPED or not (DEFAULT_COMFY_DIR / "comfy").is_dir():
        pytest.skip(COMFY_SKIPPED or f"no ComfyUI tree at {DEFAULT_COMFY_DIR}")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "WANVACE_REPO": str(repo), "WANVACE_TINY": str(tiny_folder), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _NODE_SCRIPT],
        cwd=DEFAULT_COMFY_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tiling"] == {
        "tiled": [True, "auto", True],
        "tile_size": [True, 256, True],
        "tile_overlap": [True, 64, True],
    }
    assert report["required_tooltips"]
    assert report["prefixed"] == ["control_tiled", "control_tile_size", "control_tile_overlap"]
    assert report["valid"] is True
    assert "tile_size=250" in report["refused"]
    assert "tile_overlap=128" in report["refused_overlap"]
    assert report["free_bytes"] > 0
    assert report["old_prompt_bitwise"]
    assert report["off_bitwise"]
