"""The offline command (`python -m wanvace_core.generate`) against the shipped workflows through a real ComfyUI:
for every VACE mode, the same job gives the same latents bit for bit. Both arrange the control video and masks with
`wanvace_core.generation.tasks` (the workflows through the WanVACE Control Video, First/Last Frame and Outpaint Canvas
nodes), so the arrangement itself is held to ComfyUI's own nodes, chained as the templates had them before those
nodes existed (EmptyImage grey, SolidMask, ImagePadForOutpaint, ...).

The inputs are written at the tiny model's output size (64x48), so neither our nodes nor ComfyUI's ImageScale resize
them (PIL returns a same-size image as it is), and videos are PNG-coded (.mov, rgb24), which both ComfyUI versions and
the command read as 8-bit RGB over 255.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import node_id_of
from tests.support.vace_tasks import lossless_video
from wanvace_core import generate
from workflow_graphs import TINY_MODEL, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
WIDTH, HEIGHT, LENGTH, STEPS, SEED = 64, 48, 9, 4, 42
OUTPAINT_INNER = 32
EXTENSION_GIVEN = 5


def _write_png(path: Path, seed: int, width: int = WIDTH, height: int = HEIGHT, mask: bool = False) -> Path:
    generator = np.random.default_rng(seed)
    if mask:
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[8:32, 16:48] = 255
    else:
        pixels = generator.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return path


def _write_mov(path: Path, frames: int, seed: int, width: int = WIDTH) -> Path:
    path.write_bytes(lossless_video(frames, seed, width=width, height=HEIGHT))
    return path


def _set(workflow: dict, class_type: str, index: int, **inputs) -> None:
    ids = [key for key, node in workflow.items() if node["class_type"] == class_type]
    workflow[ids[index]]["inputs"].update(inputs)


def _job(mode: str, input_dir: Path) -> tuple[dict, list[str]]:
    """The shipped workflow of `mode` on the tiny model, reading this test's inputs, and the same job as flags."""
    workflow = for_tiny_model(json.loads((API_DIR / f"wanvace_{mode}.json").read_text()))
    flags = []
    if mode in ("i2v", "flf2v"):
        first = _write_png(input_dir / f"generate_{mode}_first.png", 1)
        _set(workflow, "LoadImage", 0, image=first.name)
        flags += ["--image", str(first)]
    if mode == "flf2v":
        last = _write_png(input_dir / "generate_flf2v_last.png", 2)
        _set(workflow, "LoadImage", 1, image=last.name)
        flags += ["--last-image", str(last)]
    if mode == "r2v":
        for index in range(2):
            reference = _write_png(input_dir / f"generate_r2v_ref{index}.png", 3 + index, width=40, height=40)
            _set(workflow, "LoadImage", index, image=reference.name)
            flags += ["--reference", str(reference)]
    if mode in ("v2v", "inpaint", "outpaint", "extension"):
        frames = EXTENSION_GIVEN if mode == "extension" else LENGTH
        width = OUTPAINT_INNER if mode == "outpaint" else WIDTH
        video = _write_mov(input_dir / f"generate_{mode}.mov", frames, 5, width=width)
        _set(workflow, "LoadVideo", 0, file=video.name)
        flags += ["--video", str(video)]
    if mode == "inpaint":
        mask = _write_png(input_dir / "generate_inpaint_mask.png", 6, mask=True)
        _set(workflow, "LoadImageMask", 0, image=mask.name)
        flags += ["--mask", str(mask)]
    if mode == "outpaint":
        pad = (WIDTH - OUTPAINT_INNER) // 2
        flags += ["--outpaint-left", str(pad), "--outpaint-right", str(pad)]
    sampler_id = node_id_of(workflow, "WanVACESampler")
    for class_type in ("WanVACEDecode", "CreateVideo", "SaveVideo"):
        del workflow[node_id_of(workflow, class_type)]
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler_id, 0], "filename_prefix": f"generate/{mode}"},
    }
    conditioning = next(node["inputs"] for node in workflow.values() if node["class_type"] == "WanVACEConditioning")
    sampler = workflow[sampler_id]["inputs"]
    assert (conditioning["width"], conditioning["height"], conditioning["length"]) == (WIDTH, HEIGHT, LENGTH)
    assert (sampler["seed"], sampler["steps"], sampler["cfg"], sampler["cfg_low_noise"]) == (SEED, STEPS, 5.0, 5.0)
    flags += ["--prompt", conditioning["positive"], "--negative-prompt", conditioning["negative"]]
    return workflow, flags


@pytest.mark.every_variant
@pytest.mark.parametrize("mode", ["t2v", "i2v", "flf2v", "r2v", "v2v", "inpaint", "outpaint", "extension"])
def test_the_offline_command_equals_the_shipped_workflow_bitwise(comfy_server, comfy_base, tmp_path, mode):
    workflow, flags = _job(mode, comfy_base / "input")
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", (result.status, result.error)
    (latent_file,) = [path for path in result.output_files() if path.suffix == ".latent"]
    served = load_file(str(latent_file))["latent_tensor"]

    output, latent = tmp_path / f"{mode}.mp4", tmp_path / f"{mode}.latent"
    status = generate.main(
        [
            "--model",
            str(comfy_base / "models" / "diffusers" / TINY_MODEL),
            "--mode",
            mode,
            *flags,
            "--width",
            str(WIDTH),
            "--height",
            str(HEIGHT),
            "--num-frames",
            str(LENGTH),
            "--num-inference-steps",
            str(STEPS),
            "--seed",
            str(SEED),
            "--guidance-scale",
            "5.0",
            "--device",
            "cpu",
            "--output",
            str(output),
            "--save-latent",
            str(latent),
        ]
    )
    assert status == 0
    offline = load_file(str(latent))
    assert torch.equal(offline["latent_tensor"], served)
    assert "latent_format_version_0" in offline, "ComfyUI's LoadLatent would rescale latents without it"
    assert output.stat().st_size > 0


FRAMES_NODES = ("WanVACEControlVideo", "WanVACEFirstLastFrame", "WanVACEOutpaintCanvas")


def _comfyui_chain(workflow: dict, mode: str) -> dict:
    """`workflow` with its WanVACE frames node replaced by ComfyUI's own nodes, chained as the templates arranged the
    control video and masks before that node existed."""
    chain = copy.deepcopy(workflow)
    (frames_id,) = [key for key, node in chain.items() if node["class_type"] in FRAMES_NODES]
    frames = chain.pop(frames_id)["inputs"]
    conditioning = chain[node_id_of(chain, "WanVACEConditioning")]["inputs"]
    size = {"width": WIDTH, "height": HEIGHT}

    ids = (f"8{index:02d}" for index in itertools.count())

    def add(class_type: str, **inputs) -> list:
        node_id = next(ids)
        chain[node_id] = {"class_type": class_type, "inputs": inputs}
        return [node_id, 0]

    def scaled(image: list, method: str = "lanczos", **to) -> list:
        return add("ImageScale", image=image, upscale_method=method, crop="center", **(to or size))

    if mode in ("i2v", "flf2v"):
        video, masks = scaled(frames["images" if mode == "i2v" else "first_frame"]), add("SolidMask", value=0.0, **size)
        if mode == "flf2v":
            grey = add("EmptyImage", batch_size=LENGTH - 2, color=0x808080, **size)
            video = add(
                "ImageBatch", image1=add("ImageBatch", image1=video, image2=grey), image2=scaled(frames["last_frame"])
            )
            kept = add("MaskToImage", mask=masks)
            white = add("EmptyImage", batch_size=LENGTH - 2, color=0xFFFFFF, **size)
            both = add("ImageBatch", image1=add("ImageBatch", image1=kept, image2=white), image2=kept)
            masks = add("ImageToMask", image=both, channel="red")
    else:
        components = add("GetVideoComponents", video=frames["video"])
        clip = add("ImageFromBatch", image=components, batch_index=0, length=frames["length"])
        if mode == "outpaint":
            inner = {
                "width": WIDTH - frames["left"] - frames["right"],
                "height": HEIGHT - frames["top"] - frames["bottom"],
            }
            sides = {side: frames[side] for side in ("left", "top", "right", "bottom")}
            padded = add("ImagePadForOutpaint", image=scaled(clip, **inner), feathering=0, **sides)
            video, masks = padded, [padded[0], 1]
        else:
            video, masks = scaled(clip), None
            if mode == "extension":
                masks = add("SolidMask", value=0.0, **size)
            elif mode == "inpaint":
                mask_image = scaled(add("MaskToImage", mask=frames["masks"]), method="nearest-exact")
                masks = add("ImageToMask", image=mask_image, channel="red")
    conditioning["control_video"] = video
    if masks is None:
        conditioning.pop("control_masks", None)
    else:
        conditioning["control_masks"] = masks
    assert not any(
        value[0] == frames_id for node in chain.values() for value in node["inputs"].values() if isinstance(value, list)
    )
    return chain


@pytest.mark.every_variant
@pytest.mark.parametrize("mode", ["i2v", "flf2v", "v2v", "inpaint", "outpaint", "extension"])
def test_the_frames_nodes_arrange_the_inputs_as_comfyuis_own_nodes_do(comfy_server, comfy_base, mode):
    workflow, _ = _job(mode, comfy_base / "input")
    latents = {}
    for name, graph in (("ours", workflow), ("comfyui", _comfyui_chain(workflow, mode))):
        graph["900"]["inputs"]["filename_prefix"] = f"generate/{mode}_{name}"
        result = comfy_server.run_prompt(graph)
        assert result.status == "success", (name, result.status, result.error)
        (latent_file,) = [path for path in result.output_files() if path.suffix == ".latent"]
        latents[name] = load_file(str(latent_file))["latent_tensor"]
    assert torch.equal(latents["ours"], latents["comfyui"])
