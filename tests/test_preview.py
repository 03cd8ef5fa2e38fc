"""WanVACESampler's step previews (nodes/preview.py) against ComfyUI's own latent2rgb factors.

nodes/preview.py runs in a subprocess inside the ComfyUI tree (this module is that subprocess's script), with
ComfyUI's progress-bar hook replaced by one that records what the sampler would send to the server. The
expected preview is computed here, with plain torch, from `comfy.latent_formats.Wan21().latent_rgb_factors`
and bias as ComfyUI defines them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.comfy_server import DEFAULT_COMFY_DIR
from tests.support.comfyui import COMFY_SKIPPED
from wanvace_core import to_vae_space

REPO = Path(__file__).resolve().parents[1]
REFERENCES, FRAMES, HEIGHT, WIDTH, STEPS = 2, 3, 6, 8, 2
METHODS = ("latent2rgb", "auto", "none", "taesd")


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


def _preview_in_comfyui(in_file: str, out_file: str) -> None:
    """For each preview method: the progress-bar calls nodes/preview.py makes for STEPS steps of `latents`."""
    sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository's own `nodes` package
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.cli_args
    import comfy.latent_formats
    import comfy.utils

    spec = importlib.util.spec_from_file_location("wanvace_preview", REPO / "nodes" / "preview.py")
    preview = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preview)

    inputs = torch.load(in_file, weights_only=True)
    calls: list[dict] = []

    def hook(value, total, image, node_id=None) -> None:
        record = {"value": value, "total": total, "image": None}
        if image is not None:
            image_format, pil_image, max_size = image
            pixels = torch.frombuffer(bytearray(pil_image.tobytes()), dtype=torch.uint8)
            record.update(
                format=image_format,
                image=pixels.view(pil_image.height, pil_image.width, len(pil_image.getbands())),
                max_size=max_size,
            )
        calls.append(record)

    comfy.utils.set_progress_bar_global_hook(hook)
    lighttae = _random_lighttae(Path(out_file).parent / "vae_approx")
    model = SimpleNamespace(device=torch.device("cpu"))
    conditioning = SimpleNamespace(num_reference_images=REFERENCES)
    results = {}
    for method in METHODS:
        # What --preview-method sets (and, in ComfyUI 0.33, a prompt's own preview_method override).
        comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod(method)
        calls.clear()
        step = preview.step_previewer(model, conditioning, STEPS)
        for index, latents in enumerate(inputs["steps"]):
            step(index, STEPS, latents)
        results[method] = list(calls)
    wan21 = comfy.latent_formats.Wan21()
    torch.save(
        {
            "calls": results,
            "lighttae": [_lighttae_image(lighttae, latents[:, :, REFERENCES:]) for latents in inputs["steps"]],
            "factors": torch.tensor(wan21.latent_rgb_factors),
            "bias": None if wan21.latent_rgb_factors_bias is None else torch.tensor(wan21.latent_rgb_factors_bias),
            "process_in": wan21.process_in(inputs["raw"]),
        },
        out_file,
    )


def _random_lighttae(folder: Path) -> Path:
    """A random-weight LightTAE for Wan 2.1 (ComfyUI's own TAEHV module) in a vae_approx folder ComfyUI searches.
    Stored as fp32: ComfyUI reads a float16 file of this layout as HunyuanVideo's taehv."""
    import comfy.taesd.taehv
    import folder_paths
    from safetensors.torch import save_file

    torch.manual_seed(0)
    module = comfy.taesd.taehv.TAEHV(latent_channels=16)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "lighttaew2_1.safetensors"
    save_file({name: value.contiguous() for name, value in module.state_dict().items()}, str(path))
    folder_paths.add_model_folder_path("vae_approx", str(folder))
    return path


def _lighttae_image(path: Path, x0: torch.Tensor) -> torch.Tensor:
    """What ComfyUI's own TAEHV previewer draws for `x0` (the video's latents, reference frames removed)."""
    import comfy.sd
    import comfy.utils
    import latent_preview

    vae = comfy.sd.VAE(comfy.utils.load_torch_file(str(path)))
    vae.first_stage_model.show_progress_bar = False
    image = latent_preview.TAEHVPreviewerImpl(vae).decode_latent_to_preview(x0)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(image.height, image.width, len(image.getbands()))


# --- the pytest side -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comfy_previews(tmp_path_factory, loaded_models):
    if COMFY_SKIPPED or not (DEFAULT_COMFY_DIR / "comfy").is_dir():
        pytest.skip(f"SKIPPED: no ComfyUI tree for this dependency set ({COMFY_SKIPPED or DEFAULT_COMFY_DIR})")
    folder = tmp_path_factory.mktemp("preview")
    generator = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        latents = torch.randn(1, 16, REFERENCES + FRAMES, HEIGHT, WIDTH, generator=generator)
        # Reference frames far from the video's, so a preview drawn from them saturates and cannot pass.
        latents[:, :, :REFERENCES] = 8.0
        steps.append(latents)
    normalised = torch.randn(1, 16, FRAMES, HEIGHT, WIDTH, generator=generator)
    inputs = {
        "steps": steps,
        "normalised": normalised,
        "raw": to_vae_space(loaded_models("fp32"), normalised),  # what WanVACESampler outputs as its LATENT
    }
    torch.save(inputs, folder / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(Path(__file__).resolve()), str(folder / "in.pt"), str(folder / "out.pt")]
    done = subprocess.run(command, cwd=DEFAULT_COMFY_DIR, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the preview run in ComfyUI failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return inputs, torch.load(folder / "out.pt", weights_only=True)


def _latent2rgb(frame: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One latent frame [C, h, w] -> [h, w, 3] uint8: factors [C, 3] (+ bias), then -1..1 to 0..255."""
    rgb = torch.einsum("chw,cr->hwr", frame, factors)
    if bias is not None:
        rgb = rgb + bias
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).to(torch.uint8)


@pytest.mark.parametrize("method", ["latent2rgb", "auto"])
def test_each_step_previews_the_latent2rgb_image_of_the_first_video_frame(method, comfy_previews):
    inputs, out = comfy_previews
    calls = out["calls"][method]
    assert [(call["value"], call["total"]) for call in calls] == [(i + 1, STEPS) for i in range(STEPS)]
    for call, latents in zip(calls, inputs["steps"], strict=True):
        assert call["format"] == "JPEG" and call["max_size"] > 0
        expected = _latent2rgb(latents[0, :, REFERENCES], out["factors"], out["bias"])
        image = call["image"]
        assert image.shape == (HEIGHT, WIDTH, 3)
        # ComfyUI projects with F.linear, this with einsum: a sum order apart, so a value on a .0 boundary may
        # truncate one step lower on one side.
        assert (image.int() - expected.int()).abs().max() <= 1
        assert (image == expected).float().mean() > 0.95
        with_references = _latent2rgb(latents[0, :, 0], out["factors"], out["bias"])
        assert (image.int() - with_references.int()).abs().max() > 1  # the reference frames were dropped
    first, second = (call["image"] for call in calls)
    assert not torch.equal(first, second)  # each step's own latents


def test_taesd_previews_through_lighttae_when_its_file_is_in_vae_approx(comfy_previews):
    _inputs, out = comfy_previews
    calls = out["calls"]["taesd"]
    assert [(call["value"], call["total"]) for call in calls] == [(i + 1, STEPS) for i in range(STEPS)]
    for call, expected in zip(calls, out["lighttae"], strict=True):
        assert call["format"] == "JPEG"
        assert call["image"].shape == expected.shape and call["image"].shape[:2] == (HEIGHT * 8, WIDTH * 8)
        assert torch.equal(call["image"], expected)


def test_no_preview_with_method_none(comfy_previews):
    _inputs, out = comfy_previews
    calls = out["calls"]["none"]
    assert [(call["value"], call["total"], call["image"]) for call in calls] == [
        (i + 1, STEPS, None) for i in range(STEPS)
    ]


def test_sampler_latents_are_comfyuis_process_in_space_for_wan21(comfy_previews):
    """ComfyUI's previewers take latents in the model's process_in space; Wan21's process_in of the raw LATENT
    the sampler outputs gives back the normalised latents the step callback passes."""
    inputs, out = comfy_previews
    torch.testing.assert_close(out["process_in"], inputs["normalised"], rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    _preview_in_comfyui(sys.argv[1], sys.argv[2])
