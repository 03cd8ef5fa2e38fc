"""Live step previews for WanVACESampler through ComfyUI's own previewer and progress bar.

ComfyUI's samplers hand `latent_preview.get_previewer` the denoised estimate x0 in the model's `process_in` space;
for Wan 2.1's VAE (`comfy.latent_formats.Wan21`) that is `(raw - latents_mean) / latents_std`, which is how
diffusers normalises the latents it denoises, so the sampler's estimate goes to the previewer as it is. A previewer
is LightTAE (`lighttaew2_1*` in `models/vae_approx` with `--preview-method taesd`) or latent2rgb, as ComfyUI picks.
This module imports nothing from the rest of the package, so tests can load it on its own inside a
ComfyUI tree (whose `nodes.py` shadows this package's `nodes`).
"""

from __future__ import annotations

from collections.abc import Callable

import comfy.latent_formats
import comfy.utils
import latent_preview
import torch

# What ComfyUI's own sampler callback (latent_preview.prepare_callback) asks its previewer for.
PREVIEW_FORMAT = "JPEG"


def step_previewer(model, conditioning, steps: int) -> Callable[[int, int, torch.Tensor], None]:
    """A sampler step callback `(index, total, denoised)` that moves ComfyUI's progress bar by one step and
    attaches a preview of the denoised estimate (`[1, C, references + T, h, w]`, normalised) when the server's
    `--preview-method` (or the prompt's own override) gives a previewer.

    The previewer is chosen once, here, per run, as ComfyUI's KSampler does; with `none` it is None and a
    step costs nothing beyond the progress update.
    """
    progress = comfy.utils.ProgressBar(steps)
    previewer = latent_preview.get_previewer(model.device, comfy.latent_formats.Wan21())
    # The reference images' latent frames lead the video and are cut from the result; they would be all
    # the preview shows, since ComfyUI's video previewers draw the first latent frame.
    references = conditioning.num_reference_images

    def on_step(index: int, total: int, denoised: torch.Tensor) -> None:
        preview = None
        if previewer is not None:
            preview = previewer.decode_latent_to_preview_image(PREVIEW_FORMAT, denoised[:, :, references:])
        # An adaptive solver (dpm_adaptive) may report more steps than its schedule has.
        progress.update_absolute(min(index + 1, total), total, preview)

    return on_step
