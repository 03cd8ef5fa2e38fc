"""Our nodes next to ComfyUI's own text-encoder and VAE nodes, through a real server.

The prompts run on the session's server; what this module needs besides its model files it adds for its duration.

(a) Our sampler's LATENT decoded by core VAELoader + VAEDecode / VAEDecodeTiled
equals our WanVACEDecode: the LATENT is raw VAE space, which is what core VAEDecode takes (ComfyUI's
`latent_formats.Wan21.process_out` = ours `to_vae_space`: latents * std + mean). The VAE file is the tiny
COMFY_SHAPED pipeline's own VAE in the original Wan keys (tests/support/single_files.py `write_vae`), in fp32.
Frames go out losslessly: IMAGE -> VAEEncode(pixel_space) (IMAGE * 2 - 1, fp32) -> SaveLatent. Measured max
|difference| of the frames ([0, 1]): 1.5e-6 (PSNR 132 dB) with 0.33, 1.6e-6 (133 dB) with 0.3.75, the same for
VAEDecode and for VAEDecodeTiled with one tile covering the clip. A VAEDecodeTiled that really splits the
clip (temporal_size 8) differs by design (each temporal tile restarts the VAE's causal cache: 18 dB on this
random-weight VAE), so it is not compared.

(b) CONDITIONING into WanVACEConditioning. Core CLIPLoader(type wan) builds only the full-size UMT5-XXL,
so no core node encodes text with the tiny encoder in a server. Instead ComfyUI's own Wan text-encoder
classes encode the prompts in a subprocess (tests/test_comfy_conditioning.py) and the CONDITIONING they
return reaches the server through core LoadTrainingDataset, which reads a `shard_*.pkl` of
{"latents": [...], "conditioning": [...]} with torch.load(weights_only=True) in both ComfyUI versions
(0.3.75: a folder under output/; 0.33: a folder under datasets/ listed when it holds metadata.json).
Core LotusConditioning (no inputs) gives a CONDITIONING of the wrong width (SD2's 1024).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.metrics import psnr
from tests.support.single_files import write_umt5, write_vae
from tests.test_comfy_conditioning import LATENT_ATOL, comfy_encode
from wanvace_core.load.tiny import sentencepiece_model_bytes

pytestmark = pytest.mark.integration

MODEL = "wanvace-comfy-shaped"
# Not the session's wan_2.1_vae.safetensors: the same VAE in bf16, which would not match our fp32 decode.
VAE_FILE = "wan_2.1_vae_fp32_interop.safetensors"
POSITIVE = "a bird flies over the sea at sunset, the camera follows it"
NEGATIVE = "low quality, blurry, static"
DATASETS = {"positive": "wanvace_interop_positive", "negative": "wanvace_interop_negative"}
SIZE = {"width": 64, "height": 48, "length": 9}
FRAME_ATOL = 1e-5


def _write_dataset(base, name: str, conditioning: list) -> list[Path]:
    """One sample for LoadTrainingDataset, where either ComfyUI version looks for it; returns the folders."""
    shard = {"latents": [{"samples": torch.zeros(1, 16, 1, 6, 8)}], "conditioning": [conditioning]}
    folders = []
    for root in (base / "output", base / "datasets"):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(shard, folder / "shard_0000.pkl")
        (folder / "metadata.json").write_text("{}\n")  # 0.33 lists dataset folders by this file
        folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def interop_server(comfy_server, comfy_base, comfy_shaped_folder, comfy_components_default, tmp_path_factory):
    """The session's server, with what this module adds to its base: the session's COMFY_SHAPED pipeline folder
    linked into models/diffusers, its VAE as an fp32 file in models/vae, and the prompts encoded by ComfyUI's own
    text encoder as datasets. Removed after the module."""
    pipeline = comfy_base / "models" / "diffusers" / MODEL
    pipeline.symlink_to(comfy_shaped_folder, target_is_directory=True)
    vae = write_vae(comfy_base / "models" / "vae" / VAE_FILE, comfy_components_default["vae"], dtype=torch.float32)
    work = tmp_path_factory.mktemp("comfy_interop")
    umt5 = write_umt5(
        work / "umt5_xxl_fp32.safetensors",
        comfy_components_default["text_encoder"],
        sentencepiece_model_bytes(),
        dtype=torch.float32,
    )
    encoded = comfy_encode(umt5, [POSITIVE, NEGATIVE], work / "encoded.pt")
    datasets = [
        _write_dataset(comfy_base, DATASETS["positive"], encoded[0]["conditioning"]),
        _write_dataset(comfy_base, DATASETS["negative"], encoded[1]["conditioning"]),
    ]
    try:
        yield comfy_server
    finally:
        pipeline.unlink()
        vae.unlink()
        for folder in (folder for folders in datasets for folder in folders):
            shutil.rmtree(folder)


def _graph(prefix: str, **conditioning) -> dict:
    """Loader (fp32) -> WanVACEConditioning -> WanVACESampler -> SaveLatent; `conditioning` sets its inputs."""
    inputs = {"model": ["1", 0], "positive": POSITIVE, "negative": NEGATIVE, "strength": 1.0, **SIZE}
    inputs.update(conditioning)
    return {
        "1": {"class_type": "WanVACEModelLoader", "inputs": {"model_name": MODEL, "dtype": "fp32"}},
        "2": {"class_type": "WanVACEConditioning", "inputs": inputs},
        "3": {
            "class_type": "WanVACESampler",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["2", 0],
                "seed": 11,
                "steps": 4,
                "cfg": 5.0,
                "cfg_low_noise": 5.0,
                "boundary_ratio": -1.0,
                "shift": 0.0,
                "scheduler": "unipc",
            },
        },
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": f"{prefix}/latent"}},
    }


def _save_frames(graph: dict, node_id: str, images: list, prefix: str) -> None:
    """IMAGE -> VAEEncode(pixel_space) -> SaveLatent: the frames as fp32, losslessly (IMAGE * 2 - 1)."""
    graph[f"{node_id}1"] = {"class_type": "VAEEncode", "inputs": {"pixels": images, "vae": ["90", 0]}}
    graph[f"{node_id}2"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [f"{node_id}1", 0], "filename_prefix": f"{prefix}/{node_id}"},
    }


def _run(server, graph: dict, ran: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Runs `graph`; returns each SaveLatent's tensor by its filename_prefix's last part. The nodes `ran` must have
    run in this prompt (not come from ComfyUI's output cache)."""
    result = server.run_prompt(graph, timeout=600)
    assert result.status == "success", (result.error or result.response, server.log_tail(80))
    result.assert_ran(*ran)
    # SaveLatent writes <prefix's folder>/<prefix's name>_00001_.latent.
    return {
        path.name.split("_")[0]: load_file(str(path))["latent_tensor"]
        for path in result.output_files()
        if path.suffix == ".latent"
    }


def _frames(latent: torch.Tensor) -> torch.Tensor:
    """SaveLatent's copy of VAEEncode(pixel_space) output back to [frames, H, W, 3] in [0, 1]."""
    return ((latent + 1.0) / 2.0).movedim(1, -1)


def test_core_vae_decode_of_our_latent_matches_our_decode(interop_server):
    graph = _graph("interop_vae")
    graph["90"] = {"class_type": "VAELoader", "inputs": {"vae_name": "pixel_space"}}
    graph["91"] = {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}}
    graph["5"] = {"class_type": "WanVACEDecode", "inputs": {"model": ["1", 0], "samples": ["3", 0]}}
    graph["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["91", 0]}}
    graph["7"] = {
        "class_type": "VAEDecodeTiled",
        "inputs": {
            "samples": ["3", 0],
            "vae": ["91", 0],
            "tile_size": 512,
            "overlap": 64,
            "temporal_size": 64,
            "temporal_overlap": 8,
        },
    }
    for node_id in ("5", "6", "7"):
        _save_frames(graph, node_id, [node_id, 0], "interop_vae")
    saved = _run(interop_server, graph)
    ours, core, tiled = (_frames(saved[name]) for name in ("5", "6", "7"))
    assert ours.shape == core.shape == tiled.shape == (SIZE["length"], SIZE["height"], SIZE["width"], 3)
    assert (core - ours).abs().max() <= FRAME_ATOL and psnr(ours, core) > 100
    assert (tiled - ours).abs().max() <= FRAME_ATOL and psnr(ours, tiled) > 100


def test_comfyui_conditioning_samples_the_text_path_video(interop_server):
    text_path = _run(interop_server, _graph("interop_text"))["latent"]
    graph = _graph(
        "interop_cond",
        positive="",  # replaced by positive_conditioning, so it may be empty
        negative="",
        positive_conditioning=["20", 1],
        negative_conditioning=["21", 1],
    )
    graph["20"] = {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": DATASETS["positive"]}}
    graph["21"] = {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": DATASETS["negative"]}}
    from_comfy = _run(interop_server, graph, ran=("3",))["latent"]
    assert from_comfy.shape == text_path.shape == (1, 16, 3, 6, 8)
    # The unit test's sampler tolerance, here in raw VAE space (latents * std + mean): measured max 9.3e-6 with
    # 0.33 (latents up to 11), 1.1e-5 with 0.3.75 (up to 15).
    assert (from_comfy - text_path).abs().max() <= LATENT_ATOL


def test_empty_positive_text_is_refused_at_queue_time_without_positive_conditioning(interop_server):
    result = interop_server.run_prompt(_graph("interop_empty", positive="  "))
    assert result.status == "rejected"
    errors = result.node_errors["2"]["errors"]
    # ComfyUI repeats a validate_inputs refusal under each argument it passed; an unconnected
    # positive_conditioning is not passed.
    names = {error["extra_info"]["input_name"] for error in errors}
    assert "positive" in names and "positive_conditioning" not in names
    message = "positive prompt is empty and positive_conditioning is not connected; describe the video you want"
    assert all(message in error["details"] for error in errors), errors


def _failure(server, graph: dict) -> str:
    result = server.run_prompt(graph, timeout=300)
    assert result.status == "error", result.status
    assert result.error["node_id"] == "2", result.error
    return result.error["exception_message"]


def test_a_conditioning_of_another_text_encoder_is_refused_naming_the_input(interop_server):
    # An empty positive text passes the queue-time check once positive_conditioning is connected.
    graph = _graph("interop_width", positive="", positive_conditioning=["20", 0])
    graph["20"] = {"class_type": "LotusConditioning", "inputs": {}}
    message = _failure(interop_server, graph)
    assert (
        "positive_conditioning is 1024 wide but this model needs 4096-wide umt5 embeddings; load umt5_xxl with "
        "CLIPLoader type wan and encode the prompt with CLIPTextEncode." in message
    ), message


def test_several_conditioning_entries_are_refused(interop_server):
    graph = _graph("interop_entries", negative_conditioning=["22", 0])
    graph["20"] = {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": DATASETS["negative"]}}
    graph["22"] = {
        "class_type": "ConditioningCombine",
        "inputs": {"conditioning_1": ["20", 1], "conditioning_2": ["20", 1]},
    }
    message = _failure(interop_server, graph)
    assert "negative_conditioning holds 2 conditioning entries (from ConditioningCombine or similar)" in message
