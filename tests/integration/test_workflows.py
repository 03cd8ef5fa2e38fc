"""The shipped workflows and the WanVACE nodes inside a real ComfyUI server, driven through POST /prompt."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from bench.rss import file_mappings
from tests.support.api_graphs import node_id_of, nodes_of_type
from tests.support.comfyui import count_video_frames
from workflow_graphs import LONG_VARIANT, TINY_MODEL, WORKFLOWS, for_tiny_model, loader_class

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
TINY_LENGTH, TINY_STEPS = 9, 4
LONG_TINY_LENGTH = 33  # the long variants' 241 frames, on the tiny model: three 17-frame windows


def _api_twin(task: str) -> dict:
    return json.loads((API_DIR / f"wanvace_{task}.json").read_text())


def _with_saved_latent(workflow: dict, prefix: str) -> dict:
    """Adds core SaveLatent after the sampler so runs can be compared bit for bit."""
    workflow = dict(workflow)
    sampler = node_id_of(workflow, "WanVACESampler")
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": f"wanvace_test/{prefix}"},
    }
    return workflow


def _saved_latent(result) -> torch.Tensor:
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _set_input(workflow: dict, class_type: str, **values) -> dict:
    for node in nodes_of_type(workflow, class_type):
        node["inputs"].update(values)
    return workflow


def _t2v(seed: int, prefix: str, model: str = TINY_MODEL, **sampler_inputs) -> dict:
    workflow = _with_saved_latent(for_tiny_model(_api_twin("t2v"), model_name=model), prefix)
    return _set_input(workflow, "WanVACESampler", seed=seed, **sampler_inputs)


@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_shipped_workflow_runs_and_writes_a_video(task, comfy_server):
    workflow = for_tiny_model(_api_twin(task))
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", result.error or result.response

    videos = [p for p in result.output_files() if p.suffix == ".mp4"]
    assert len(videos) == 1 and videos[0].stat().st_size > 0
    conditioning = nodes_of_type(workflow, "WanVACEConditioning")[0]["inputs"]
    assert count_video_frames(videos[0]) == conditioning["length"]
    assert conditioning["length"] == (LONG_TINY_LENGTH if task.endswith(LONG_VARIANT) else TINY_LENGTH)

    sampler = node_id_of(workflow, "WanVACESampler")
    progress = [event for event in result.progress_events() if event.get("node") == sampler]
    values = [event["value"] for event in progress]
    # ComfyUI 0.33 drops progress messages under 100 ms apart, except the first and the last one
    # (comfy.utils.ProgressBar throttling); 0.3.75 sends every step.
    assert values[0] == 1 and values[-1] == TINY_STEPS and values == sorted(set(values)), values
    if comfy_server.system_stats()["system"].get("comfyui_version") == "0.3.75":
        assert values == list(range(1, TINY_STEPS + 1))
    assert all(event["max"] == TINY_STEPS for event in progress)
    for class_type in (loader_class(task), "WanVACEConditioning", "WanVACESampler", "WanVACEDecode"):
        node_id = node_id_of(workflow, class_type)
        assert node_id in result.started_nodes() or node_id in result.cached_nodes()


def test_server_latents_equal_diffusers_pipeline(comfy_server, comfy_base):
    """POST /prompt through our nodes gives the diffusers WanVACEPipeline result, bit for bit."""
    from diffusers import WanVACEPipeline

    workflow = _t2v(seed=7, prefix="parity")
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", result.error
    served = _saved_latent(result)

    conditioning = nodes_of_type(workflow, "WanVACEConditioning")[0]["inputs"]
    pipeline = WanVACEPipeline.from_pretrained(
        comfy_base / "models" / "diffusers" / TINY_MODEL, torch_dtype=torch.bfloat16
    )
    pipeline.set_progress_bar_config(disable=True)
    latents = pipeline(
        prompt=conditioning["positive"],
        negative_prompt=conditioning["negative"],
        width=conditioning["width"],
        height=conditioning["height"],
        num_frames=conditioning["length"],
        num_inference_steps=TINY_STEPS,
        guidance_scale=5.0,
        guidance_scale_2=5.0,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames
    vae = pipeline.vae
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents.dtype)
    expected = (latents / inverse_std + mean).float()
    assert served.shape == expected.shape
    assert torch.equal(served, expected)


@pytest.mark.parametrize("runs", [2, 10])
def test_consecutive_prompts_all_succeed_with_identical_results(runs, comfy_server):
    seeds = [11 if index % 2 == 0 else 12 for index in range(runs)]
    latents: dict[int, list[torch.Tensor]] = {11: [], 12: []}
    for index, seed in enumerate(seeds):
        result = comfy_server.run_prompt(_t2v(seed, prefix=f"consecutive{runs}_{index}"))
        assert result.status == "success", (index, result.error)
        # Alternating seeds: ComfyUI has dropped the other seed's sampler output, so each prompt samples.
        latents[seed].append(_saved_latent(result.assert_ran(node_id_of(_t2v(seed, "x"), "WanVACESampler"))))
    for seed, tensors in latents.items():
        assert all(torch.equal(tensors[0], other) for other in tensors[1:]), seed
    assert not torch.equal(latents[11][0], latents[12][0])


def test_cancelled_prompt_then_next_prompt_gives_uncancelled_result(comfy_server):
    # Long enough that the cancel, sent at the second progress message, lands mid-run (0.33 sends progress at most
    # every 100 ms); every step of the two uncancelled runs below costs as much again.
    steps = 40
    long_run = {"steps": steps}
    cancelled = comfy_server.run_prompt(_t2v(21, "cancel_a", **long_run), interrupt_after_progress=2)
    assert cancelled.status == "interrupted"
    sampler = node_id_of(_t2v(21, "x"), "WanVACESampler")
    steps_seen = [event["value"] for event in cancelled.progress_events() if event.get("node") == sampler]
    assert steps_seen and max(steps_seen) < steps

    after = comfy_server.run_prompt(_t2v(21, "cancel_b", **long_run))
    assert after.status == "success", after.error
    # Another seed takes the place of the first one's outputs in ComfyUI's cache; it need not run long.
    other = comfy_server.run_prompt(_t2v(22, "cancel_c"))
    assert other.status == "success"
    again = comfy_server.run_prompt(_t2v(21, "cancel_d", **long_run))
    assert again.status == "success"
    assert torch.equal(_saved_latent(after), _saved_latent(again.assert_ran(sampler)))


def _assert_serving(server) -> None:
    assert requests.get(f"{server.url}/system_stats", timeout=10).status_code == 200
    result = server.run_prompt(_t2v(int(time.time()) % 1000 + 100, "still_serving"))
    assert result.status == "success", result.error


@pytest.mark.parametrize(
    ("class_type", "values", "fragment"),
    [
        ("WanVACEConditioning", {"length": 10}, "length=10"),
        ("WanVACEConditioning", {"width": 72}, "width=72"),
        ("WanVACEConditioning", {"height": 40}, "height=40"),
        ("WanVACEConditioning", {"positive": "   "}, "positive prompt is empty"),
        ("WanVACEModelLoader", {"model_name": "not-a-vace-pipeline"}, "FluxPipeline"),
        ("WanVACEModelLoader", {"model_name": "wanvace-truncated"}, "truncated"),
        ("WanVACEModelLoader", {"model_name": "does-not-exist"}, "does-not-exist"),
        ("WanVACESampler", {"cfg": 0.5}, "cfg"),
    ],
)
def test_bad_widget_inputs_are_refused_at_queue_time(class_type, values, fragment, comfy_server):
    workflow = _set_input(for_tiny_model(_api_twin("t2v")), class_type, **values)
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected"
    node_id = node_id_of(workflow, class_type)
    errors = result.node_errors[node_id]["errors"]
    assert any(fragment in json.dumps(error) for error in errors), errors
    _assert_serving(comfy_server)


def test_control_video_takes_a_video_or_images_not_both(comfy_server):
    """WanVACE Control Video refuses at queue time a graph that connects both of its sources, naming them."""
    workflow = for_tiny_model(_api_twin("v2v"))
    (control,) = [node for node in workflow.values() if node["class_type"] == "WanVACEControlVideo"]
    workflow["800"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 3, "color": 0}}
    control["inputs"]["images"] = ["800", 0]
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected"
    errors = json.dumps(result.node_errors[node_id_of(workflow, "WanVACEControlVideo")]["errors"])
    assert "connect video" in errors and "both are connected" in errors, errors
    _assert_serving(comfy_server)


def _control_graph(video_frames: int, video_size: tuple[int, int], mask_frames: int | None) -> dict:
    workflow = for_tiny_model(_api_twin("t2v"))
    width, height = video_size
    workflow["800"] = {
        "class_type": "EmptyImage",
        "inputs": {"width": width, "height": height, "batch_size": video_frames, "color": 0x336699},
    }
    conditioning = nodes_of_type(workflow, "WanVACEConditioning")[0]["inputs"]
    conditioning["control_video"] = ["800", 0]
    if mask_frames is not None:
        workflow["801"] = {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": mask_frames, "color": 0},
        }
        workflow["802"] = {"class_type": "ImageToMask", "inputs": {"image": ["801", 0], "channel": "red"}}
        conditioning["control_masks"] = ["802", 0]
    return workflow


@pytest.mark.parametrize(
    ("video_frames", "video_size", "mask_frames", "fragment"),
    [
        (3, (64, 48), 2, "control_masks has 2 frames but control_video has 3"),
        (3, (32, 32), None, "control_video is 32x32 but the video is 64x48"),
        (12, (64, 48), None, "control_video has 12 frames but length=9"),
    ],
)
def test_mismatched_control_inputs_fail_with_a_node_error(
    video_frames, video_size, mask_frames, fragment, comfy_server
):
    workflow = _control_graph(video_frames, video_size, mask_frames)
    result = comfy_server.run_prompt(workflow)
    assert result.status == "error"
    assert result.error["node_type"] == "WanVACEConditioning"
    assert fragment in result.error["exception_message"]
    sampler = node_id_of(workflow, "WanVACESampler")
    assert sampler not in result.started_nodes()
    _assert_serving(comfy_server)


def test_valid_control_inputs_run(comfy_server):
    result = comfy_server.run_prompt(_control_graph(3, (64, 48), 1))
    assert result.status == "success", result.error


def test_single_expert_wan21_folder_runs(comfy_server):
    workflow = _set_input(for_tiny_model(_api_twin("t2v")), "WanVACEModelLoader", model_name="wanvace21-tiny")
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", result.error


def test_model_stays_loaded_and_is_released_on_free(comfy_server, comfy_base):
    """Measured in the server process: the tiny model's expert weights are used in place from their memory-mapped
    files, so `/proc/<pid>/smaps` shows whether they are held and where."""
    name = f"{TINY_MODEL}-free"  # a copy of its own: only this test's prompts map its files
    folder = comfy_base / "models" / "diffusers" / name
    shutil.copytree(comfy_base / "models" / "diffusers" / TINY_MODEL, folder)
    loader = node_id_of(_t2v(31, "x"), "WanVACEModelLoader")
    sampler = node_id_of(_t2v(31, "x"), "WanVACESampler")

    first = comfy_server.run_prompt(_t2v(31, "free_a", model=name))
    assert first.status == "success", first.error
    loaded = _expert_mappings(comfy_server, folder)
    assert set(loaded) == {"transformer", "transformer_2"}, loaded
    result = comfy_server.run_prompt(_t2v(32, "free_b", model=name))
    assert result.status == "success", result.error
    # The loader's output came from ComfyUI's cache and the weights are still those mapped for the first prompt.
    assert loader in result.assert_ran(sampler).cached_nodes()
    assert _expert_mappings(comfy_server, folder) == loaded, "model reloaded between prompts"

    releases_before = comfy_server.log_text().count("Released WanVACE pipeline")
    comfy_server.free(unload_models=True, free_memory=True)
    assert _expert_mappings(comfy_server, folder) == {}, "POST /free left the weights in memory"
    # That the pipeline object itself is gone (its text encoder and VAE, a few hundred KiB of the server's private
    # memory) is no measurable amount: the pack's account of it is the evidence.
    assert comfy_server.log_text().count("Released WanVACE pipeline") > releases_before

    again = comfy_server.run_prompt(_t2v(31, "free_c", model=name))
    assert again.status == "success", again.error
    again.assert_ran(loader, sampler)
    assert set(_expert_mappings(comfy_server, folder)) == {"transformer", "transformer_2"}, "weights not read back"
    assert torch.equal(_saved_latent(again), _saved_latent(first))


def _expert_mappings(server, folder) -> dict[str, tuple]:
    """Expert weight file -> the address ranges the server maps it at."""
    return {
        Path(path).parent.name: mapping.ranges
        for path, mapping in file_mappings(server.proc.pid, folder).items()
        if path.endswith(".safetensors")
    }


def test_every_node_and_input_is_described(comfy_server):
    info = comfy_server.object_info()
    ours = {name: node for name, node in info.items() if name.startswith("WanVACE")}
    assert set(ours) == {
        "WanVACEModelLoader",
        "WanVACEExpertsLoader",
        "WanVACEConditioning",
        "WanVACEControlVideo",
        "WanVACEFirstLastFrame",
        "WanVACEOutpaintCanvas",
        "WanVACESampler",
        "WanVACEDecode",
        "WanVACECacheOptions",
        "WanVACEContextWindows",
        "WanVACEOffloadOptions",
        "WanVACEParallelOptions",
        "WanVACELoraLoader",
        "WanVACEScheduler",
        "WanVACEGuidanceOptions",
    }
    for name, node in ours.items():
        assert node["description"].strip(), name
        assert node["category"] == "WanVACE"
        for section in ("required", "optional"):
            for input_name, spec in node["input"].get(section, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                assert options.get("tooltip", "").strip(), (name, input_name)
        assert all(tooltip and tooltip.strip() for tooltip in node["output_tooltips"]), name
    assert TINY_MODEL in info["WanVACEModelLoader"]["input"]["required"]["model_name"][1]["options"]
