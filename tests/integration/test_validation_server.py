"""Refusals at POST /prompt name their input once: one node_errors entry, under that input, naming it and the value.

NaN and Infinity go through the real HTTP path as the JSON literals Python's json.dumps writes (requests'
`json=` refuses them), which ComfyUI's prompt parser accepts. Two tables: every range a widget of ours declares,
read from the server's /object_info (min - 1, max + 1, NaN for floats), and bad inputs against the features
(sizes the model cannot run, context windows, cache, LoRA, offload, parallel, tiling, loaders).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from workflow_graphs import FP8_VARIANT, LIGHTNING_NAG, SINGLE_FILES, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
NAN, INF = float("nan"), float("inf")


def _t2v() -> dict:
    return for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))


def _node_id(workflow: dict, class_type: str) -> str:
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return node_id


def _with(workflow: dict, class_type: str, **values) -> tuple[dict, str]:
    node_id = _node_id(workflow, class_type)
    workflow[node_id]["inputs"].update(values)
    return workflow, node_id


def _with_offload(**values) -> tuple[dict, str]:
    workflow = _t2v()
    offload = {"mode": "model", "prefetch_blocks": 1, "max_pinned_mb": 0, **values}
    workflow["600"] = {"class_type": "WanVACEOffloadOptions", "inputs": offload}
    workflow[_node_id(workflow, "WanVACEModelLoader")]["inputs"]["offload"] = ["600", 0]
    return workflow, "600"


def _with_cache(workflow: dict | None = None, **values) -> tuple[dict, str]:
    workflow = workflow or _t2v()
    cache = {
        "mode": "DBCache",
        "Fn_compute_blocks": 1,
        "Bn_compute_blocks": 0,
        "residual_diff_threshold": 0.08,
        "max_warmup_steps": 2,
        "max_cached_steps": -1,
        "low_noise_max_warmup_steps": 2,
        "low_noise_max_cached_steps": -1,
        "taylorseer_order": 1,
        **values,
    }
    workflow["700"] = {"class_type": "WanVACECacheOptions", "inputs": cache}
    workflow[_node_id(workflow, "WanVACESampler")]["inputs"]["cache"] = ["700", 0]
    return workflow, "700"


def _post(server, workflow: dict) -> tuple[int, dict, str]:
    """POST /prompt with NaN/Infinity written as JSON literals; returns status, parsed body and the request text."""
    text = json.dumps({"prompt": workflow, "client_id": uuid.uuid4().hex})
    response = server.http.post(
        f"{server.url}/prompt", data=text, headers={"Content-Type": "application/json"}, timeout=120
    )
    return response.status_code, json.loads(response.text), text


def _only_error(body: dict, node_id: str) -> dict:
    node_errors = body.get("node_errors", {})
    assert list(node_errors) == [node_id], node_errors
    errors = node_errors[node_id]["errors"]
    assert len(errors) == 1, json.dumps(errors, indent=1)
    return errors[0]


def _refused_once(server, workflow: dict, node_id: str, name: str, *fragments: str) -> dict:
    code, body, _ = _post(server, workflow)
    assert code == 400, body
    error = _only_error(body, node_id)
    assert error["extra_info"]["input_name"] == name, error
    text = f"{error['message']}: {error['details']}"
    # The entry names its input: ComfyUI's details are the name ("cfg"), or start with it ("steps, nan, ...",
    # "dtype: 'fp8' not in ..."); ours follow ComfyUI's "name - " with a message that starts with the name.
    details = error["details"]
    assert details == name or details.startswith((f"{name}, ", f"{name}: ", f"{name} - {name}=", f"{name} - {name} "))
    for fragment in fragments:
        assert fragment in text, error
    return error


FLOAT_CASES = [
    # (class_type, input, value, fragment of ComfyUI's range-check message)
    ("WanVACESampler", "cfg", NAN, "Value nan smaller than min of 1.0"),
    ("WanVACESampler", "cfg", INF, "Value inf bigger than max of 30.0"),
    ("WanVACESampler", "cfg", -INF, "Value -inf smaller than min of 1.0"),
    ("WanVACESampler", "cfg_low_noise", NAN, "Value nan smaller than min of 1.0"),
    ("WanVACESampler", "boundary_ratio", NAN, "Value nan smaller than min of -1.0"),
    ("WanVACESampler", "shift", NAN, "Value nan smaller than min of 0.0"),
    ("WanVACESampler", "shift", INF, "Value inf bigger than max of 100.0"),
    ("WanVACEConditioning", "strength", NAN, "Value nan smaller than min of 0.0"),
    ("WanVACEConditioning", "strength", INF, "Value inf bigger than max of 10.0"),
]


@pytest.mark.parametrize(("class_type", "name", "value", "fragment"), FLOAT_CASES)
def test_non_finite_float_is_refused_once_under_its_input(class_type, name, value, fragment, comfy_server):
    workflow, node_id = _with(_t2v(), class_type, **{name: value})
    error = _refused_once(comfy_server, workflow, node_id, name, fragment)
    assert error["type"] in ("value_smaller_than_min", "value_bigger_than_max")


def test_nan_really_travels_as_a_json_literal(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", cfg=NAN)
    code, body, text = _post(comfy_server, workflow)
    assert '"cfg": NaN' in text
    assert code == 400 and node_id in body["node_errors"]


@pytest.mark.parametrize("value", [NAN, INF])
def test_non_finite_cache_threshold_is_refused_once(value, comfy_server):
    workflow, node_id = _with_cache(residual_diff_threshold=value)
    bound = "smaller than min of 0.001" if value != INF else "bigger than max of 1.0"
    _refused_once(comfy_server, workflow, node_id, "residual_diff_threshold", f"Value {value} {bound}")


def test_unknown_cache_mode_is_refused_once_with_our_message(comfy_server):
    workflow, node_id = _with_cache(mode="FBCache")
    _refused_once(comfy_server, workflow, node_id, "mode", "mode='FBCache' is unknown; choose one of DBCache")


def test_out_of_range_cache_count_is_refused_once_by_comfyui(comfy_server):
    # validate_inputs no longer takes every input, so ComfyUI's own range check applies again.
    workflow, node_id = _with_cache(Fn_compute_blocks=65)
    _refused_once(comfy_server, workflow, node_id, "Fn_compute_blocks", "Value 65 bigger than max of 64")


def test_nan_for_an_integer_input_is_refused_once_by_comfyui(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", steps=NAN)
    error = _refused_once(comfy_server, workflow, node_id, "steps")
    assert error["type"] == "invalid_input_type"


def test_missing_model_is_refused_once_under_model_name_saying_where_to_get_it(comfy_server):
    # The shipped template as a user without the model runs it: its model name, nothing else changed.
    workflow = json.loads((API_DIR / "wanvace_t2v.json").read_text())
    node_id = _node_id(workflow, "WanVACEModelLoader")
    name = workflow[node_id]["inputs"]["model_name"]
    _refused_once(
        comfy_server,
        workflow,
        node_id,
        "model_name",
        f"model_name={name!r} is not in ComfyUI's models/diffusers folder",
        "https://huggingface.co/Pyros13/Wan2.2-VACE-Fun-A14B-Diffusers",
        "into ComfyUI/models/diffusers/",
    )


def test_missing_single_files_are_refused_once_naming_each_with_where_to_get_it(comfy_server):
    workflow = json.loads((API_DIR / "wanvace_i2v_fp8.json").read_text())
    node_id = _node_id(workflow, "WanVACEExpertsLoader")
    loader = workflow[node_id]["inputs"]
    for key in ("high_noise_model", "low_noise_model", "text_encoder", "vae"):
        loader[key] = f"not-installed-{loader[key]}"
    error = _refused_once(
        comfy_server,
        workflow,
        node_id,
        "high_noise_model",
        "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged",
        "into ComfyUI/models/diffusion_models/",
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged",
        "into ComfyUI/models/text_encoders/",
        "into ComfyUI/models/vae/",
    )
    for key in ("high_noise_model", "low_noise_model", "text_encoder", "vae"):
        assert f"{key}='not-installed-" in error["details"], key


@pytest.mark.every_variant
@pytest.mark.parametrize(
    ("workflow_of", "class_type", "name", "value"),
    [
        (lambda: _t2v(), "WanVACEModelLoader", "dtype", "fp8"),
        (lambda: _i2v_fp8(), "WanVACEExpertsLoader", "dtype", "int8"),
        (lambda: _i2v_fp8(), "WanVACEExpertsLoader", "weight_dtype", "int4"),
        (lambda: _t2v(), "WanVACESampler", "batched_cfg", "maybe"),
    ],
)
def test_an_unknown_combo_value_is_refused_at_queue_time_in_both_versions(
    workflow_of, class_type, name, value, comfy_server
):
    # ComfyUI 0.3.75 checks no V3 combo against its options, 0.33 does; ours are checked by the nodes in both, with
    # their own message.
    workflow, node_id = _with(workflow_of(), class_type, **{name: value})
    _refused_once(comfy_server, workflow, node_id, name, f"{name}={value!r} is ", "choose one of")


def test_unknown_scheduler_is_refused_once_with_our_message(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", scheduler="ddim")
    _refused_once(comfy_server, workflow, node_id, "scheduler", "scheduler='ddim' is unknown; choose one of unipc")


def test_unknown_offload_mode_is_refused_once_under_mode(comfy_server):
    workflow, node_id = _with_offload(mode="sequential")
    _refused_once(comfy_server, workflow, node_id, "mode", "mode='sequential' is unknown; choose one of none")


@pytest.mark.parametrize(
    ("values", "name", "fragment"),
    [
        ({"mode": "layerwise", "prefetch_blocks": 17}, "prefetch_blocks", "Value 17 bigger than max of 16"),
        ({"mode": "layerwise", "max_pinned_mb": -1}, "max_pinned_mb", "Value -1 smaller than min of 0"),
    ],
)
def test_bad_offload_setting_is_refused_once_under_its_input(values, name, fragment, comfy_server):
    workflow, node_id = _with_offload(**values)
    _refused_once(comfy_server, workflow, node_id, name, fragment)


def test_shift_that_makes_the_scheduler_repeat_timesteps_fails_with_a_named_error(comfy_server):
    # Valid for the widgets (shift <= 100, steps <= 200) but unusable for UniPC: without the core's check this
    # ended in a bare AssertionError from diffusers on the last step.
    workflow, _ = _with(_t2v(), "WanVACESampler", shift=100.0, steps=20)
    result = comfy_server.run_prompt(workflow, timeout=300)
    assert result.status == "error", result.response
    error = result.error
    # ComfyUI builds exception_type from the class's module and name; ours is just the class name (not the pack's
    # path on disk, which ComfyUI's custom-node loader makes the module's name), in the dialog and in /history.
    assert error["exception_type"] == "WanVACEInputError", error
    assert error["exception_message"].startswith("shift=100.0 with steps=20 makes the unipc scheduler repeat")
    messages = dict(result.history["status"]["messages"])
    assert messages["execution_error"]["exception_type"] == "WanVACEInputError", messages


# ==================================================================================================
# File and folder inputs take only names their node lists (never a path outside the model folders)

_OUTSIDE = "outside-the-model-folders"
_EXPERT_INPUTS = (
    "high_noise_model",
    "low_noise_model",
    "text_encoder",
    "vae",
    "high_noise_vace_module",
    "low_noise_vace_module",
)


def _i2v_fp8() -> dict:
    return for_tiny_model(json.loads((API_DIR / "wanvace_i2v_fp8.json").read_text()))


def _lightning() -> dict:
    return for_tiny_model(json.loads((API_DIR / "wanvace_t2v_lightning.json").read_text()))


@pytest.fixture(scope="module")
def outside(comfy_base) -> Path:
    """A valid expert file and a valid pipeline folder beside (not inside) the server's model folders."""
    folder = comfy_base / _OUTSIDE
    if not folder.exists():
        folder.mkdir()
        expert = comfy_base / "models" / "diffusion_models" / SINGLE_FILES[FP8_VARIANT]["high_noise_model"]
        shutil.copy(expert, folder / "expert.safetensors")
        shutil.copytree(comfy_base / "models" / "diffusers" / "wanvace-tiny", folder / "pipeline")
    return folder


def _escapes(outside: Path, relative_to_folder: str) -> dict[str, str]:
    """Names that point out of a model folder: at existing files, at missing ones, and at system files."""
    return {
        "relative, exists": f"../../{_OUTSIDE}/{relative_to_folder}",
        "relative, missing": f"../../{_OUTSIDE}/missing-{relative_to_folder}",
        "absolute, exists": str(outside / relative_to_folder),
        "absolute, missing": str(outside / f"missing-{relative_to_folder}"),
        "relative system file": "../../../../../../../etc/passwd",
        "absolute system file": "/etc/passwd",
        "unlisted": "not-listed-anywhere.safetensors",
    }


def _refusal_shapes(server, workflow_of, node_id: str, name: str, values: dict[str, str]) -> set[str]:
    """POSTs each value into input `name`; every one must be refused at HTTP 400 under that node, each entry naming
    the input first. Returns the refusals with the value blanked out: one shape means the messages tell nothing about
    what exists outside the model folders."""
    shapes = set()
    for label, value in values.items():
        workflow = workflow_of()
        workflow[node_id]["inputs"][name] = value
        code, body, _ = _post(server, workflow)
        assert code == 400, (label, body)
        assert list(body["node_errors"]) == [node_id], (label, body)
        for error in body["node_errors"][node_id]["errors"]:
            message = error["details"].split(" - ", 1)[-1]
            assert message.startswith(f"{name}={value!r} is not in ComfyUI's models/"), (label, error)
            shapes.add(message.replace(repr(value), "<value>"))
    return shapes


def _trace_file_calls(server, out: Path) -> subprocess.Popen:
    """strace of every file system call of the server (all its threads), written to `out` until terminated. Returns
    once the trace is live: strace writes nothing while the server makes no file call, so the server is asked to
    list the experts loader's folders until the trace shows that listing."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing; scripts/setup.sh installs it (apt-get install strace)", pytrace=False)
    tracer = subprocess.Popen(["strace", "-f", "-e", "trace=%file", "-o", str(out), "-p", str(server.proc.pid)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        server.object_info("WanVACEExpertsLoader")
        if out.exists() and "/models/diffusion_models" in out.read_text(errors="replace"):
            return tracer
        time.sleep(0.1)
    tracer.terminate()
    pytest.fail(f"strace saw no listing of models/diffusion_models within 30 s; its output: {out}", pytrace=False)


def test_file_inputs_refuse_paths_out_of_their_folders_without_touching_them(comfy_server, outside, tmp_path):
    """Every file and folder input of both loaders and the LoRA loader, with `..`, absolute and unlisted names:
    refused at queue time, the same message whether the target exists or not, and (strace) no system call of the
    server names anything outside the model folders."""
    trace = tmp_path / "server.strace"
    tracer = _trace_file_calls(comfy_server, trace)
    try:
        experts = _i2v_fp8()
        experts_id = _node_id(experts, "WanVACEExpertsLoader")
        for name in _EXPERT_INPUTS:
            values = _escapes(outside, "expert.safetensors")
            shapes = _refusal_shapes(comfy_server, _i2v_fp8, experts_id, name, values)
            assert len(shapes) == 1, shapes
        folders = _escapes(outside, "pipeline")
        folders["system folder"] = "/etc"
        t2v_id = _node_id(_t2v(), "WanVACEModelLoader")
        assert len(_refusal_shapes(comfy_server, _t2v, t2v_id, "model_name", folders)) == 1
        lora_id = min(key for key, node in _lightning().items() if node["class_type"] == "WanVACELoraLoader")
        values = _escapes(outside, "expert.safetensors")
        assert len(_refusal_shapes(comfy_server, _lightning, lora_id, "lora_name", values)) == 1
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)
    calls = trace.read_text()
    assert "/models/diffusion_models" in calls and "/models/diffusers" in calls, "the trace saw no listing"
    touched = [line for line in calls.splitlines() if _OUTSIDE in line or "/etc/passwd" in line]
    assert not touched, "\n".join(touched[:20])


@pytest.fixture(scope="module")
def linked_models(comfy_base, tmp_path_factory):
    """What users do with weights on another disk: the fp8 experts in a subfolder of diffusion_models and in a
    folder linked into it, and the tiny pipeline folder linked into models/diffusers. Removed after the module."""
    models = comfy_base / "models"
    other_disk = tmp_path_factory.mktemp("other_disk")
    names = SINGLE_FILES[FP8_VARIANT]
    (other_disk / "experts").mkdir()
    nested = models / "diffusion_models" / "nested" / "wan22"
    nested.mkdir(parents=True)
    for key in ("high_noise_model", "low_noise_model"):
        source = models / "diffusion_models" / names[key]
        shutil.copy(source, other_disk / "experts" / names[key])
        shutil.copy(source, nested / names[key])
    shutil.copytree(models / "diffusers" / "wanvace-tiny", other_disk / "pipeline")
    links = [models / "diffusion_models" / "linked", models / "diffusers" / "linked-wanvace-tiny"]
    links[0].symlink_to(other_disk / "experts", target_is_directory=True)
    links[1].symlink_to(other_disk / "pipeline", target_is_directory=True)
    try:
        yield {"nested": "nested/wan22", "linked": "linked", "pipeline": "linked-wanvace-tiny"}
    finally:
        for link in links:
            link.unlink()
        shutil.rmtree(models / "diffusion_models" / "nested")


def _saved_latent(server, workflow: dict, prefix: str):
    """Runs only what the sampler needs (2 steps), saving its latent: enough to show a model loads and samples."""
    from safetensors.torch import load_file

    sampler = _node_id(workflow, "WanVACESampler")
    needed, todo = set(), [sampler]
    while todo:
        node_id = todo.pop()
        if node_id not in needed:
            needed.add(node_id)
            todo += [value[0] for value in workflow[node_id]["inputs"].values() if isinstance(value, list)]
    workflow = {node_id: node for node_id, node in workflow.items() if node_id in needed}
    workflow[sampler]["inputs"]["steps"] = 2
    workflow["990"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": f"wanvace_model_files/{prefix}"},
    }
    result = server.run_prompt(workflow, timeout=300)
    assert result.status == "success", (result.error, result.response)
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return result, load_file(str(path))["latent_tensor"]


def _ran_loader(result, workflow: dict, class_type: str) -> None:
    """The loader really ran for this prompt (ComfyUI did not serve its output from the cache)."""
    cached = [node for event in result.events_of("execution_cached") for node in event.get("nodes", [])]
    assert _node_id(workflow, class_type) not in cached, cached


def test_experts_in_a_subfolder_and_a_linked_folder_are_listed_and_load(comfy_server, linked_models):
    import torch

    names = SINGLE_FILES[FP8_VARIANT]
    options = comfy_server.object_info("WanVACEExpertsLoader")["WanVACEExpertsLoader"]["input"]["required"]
    listed = options["high_noise_model"][1]["options"]
    _, reference = _saved_latent(comfy_server, _i2v_fp8(), "top_level")
    for folder in (linked_models["nested"], linked_models["linked"]):
        workflow = _i2v_fp8()
        loader = workflow[_node_id(workflow, "WanVACEExpertsLoader")]["inputs"]
        for key in ("high_noise_model", "low_noise_model"):
            assert f"{folder}/{names[key]}" in listed, (folder, listed)
            loader[key] = f"{folder}/{names[key]}"
        result, latent = _saved_latent(comfy_server, workflow, folder.replace("/", "_"))
        _ran_loader(result, workflow, "WanVACEExpertsLoader")
        assert torch.equal(latent, reference), folder


def test_a_pipeline_folder_linked_into_models_diffusers_is_listed_and_loads(comfy_server, linked_models):
    import torch

    options = comfy_server.object_info("WanVACEModelLoader")["WanVACEModelLoader"]["input"]["required"]
    assert linked_models["pipeline"] in options["model_name"][1]["options"]
    _, reference = _saved_latent(comfy_server, _t2v(), "in_place")
    workflow = _t2v()
    workflow[_node_id(workflow, "WanVACEModelLoader")]["inputs"]["model_name"] = linked_models["pipeline"]
    result, latent = _saved_latent(comfy_server, workflow, "linked")
    _ran_loader(result, workflow, "WanVACEModelLoader")
    assert torch.equal(latent, reference)


def test_nan_boundary_ratio_of_the_experts_loader_is_refused_once_at_queue_time(comfy_server):
    workflow, node_id = _with(_i2v_fp8(), "WanVACEExpertsLoader", boundary_ratio=NAN)
    error = _refused_once(comfy_server, workflow, node_id, "boundary_ratio", "Value nan smaller than min of 0.0")
    assert error["type"] == "value_smaller_than_min"


def test_parallel_timeout_below_its_minimum_is_refused_before_any_worker_starts(comfy_server):
    workflow = _t2v()
    workflow["800"] = {
        "class_type": "WanVACEParallelOptions",
        "inputs": {
            "devices": "cpu,cpu",
            "shard": "fsdp",
            "replicate_size": 1,
            "ulysses_degree": 1,
            "cfg_parallel": False,
            "launcher": "local",
            "endpoint": "127.0.0.1:29511",
            "timeout_s": 0.5,
        },
    }
    workflow[_node_id(workflow, "WanVACEModelLoader")]["inputs"]["parallel"] = ["800", 0]
    workers_before = _worker_processes()
    _refused_once(comfy_server, workflow, "800", "timeout_s", "Value 0.5 smaller than min of 1.0")
    assert _worker_processes() == workers_before
    nan = json.loads(json.dumps(workflow))
    nan["800"]["inputs"]["timeout_s"] = NAN
    _refused_once(comfy_server, nan, "800", "timeout_s", "Value nan smaller than min of 1.0")


def _worker_processes() -> set[int]:
    """Pids of running parallel workers (`python -m wanvace_core.worker`)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"wanvace_core.worker" in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    ("class_type", "attention", "fragment"),
    [
        ("WanVACEModelLoader", "flash", "install `flash-attn>="),
        ("WanVACEExpertsLoader", "sage", "install `sageattention>="),
        ("WanVACEModelLoader", "_native_cudnn", "its kernel does not run on this device"),
    ],
)
def test_an_unusable_attention_kernel_is_refused_at_queue_time(class_type, attention, fragment, comfy_server):
    workflow = _t2v() if class_type == "WanVACEModelLoader" else _i2v_fp8()
    workflow, node_id = _with(workflow, class_type, attention=attention)
    error = _refused_once(comfy_server, workflow, node_id, "attention", fragment)
    assert error["details"].startswith(f"attention - attention={attention!r} cannot run on cpu: "), error


# ==================================================================================================
# Every range a widget of ours declares holds for API prompts too


def _with_windows(workflow: dict | None = None, **values) -> tuple[dict, str]:
    workflow = workflow or _t2v()
    windows = {
        "context_length": 17,
        "context_overlap": 8,
        "schedule": "standard_static",
        "context_stride": 1,
        "closed_loop": False,
        "fuse_method": "pyramid",
        "freenoise": True,
        **values,
    }
    workflow["710"] = {"class_type": "WanVACEContextWindows", "inputs": windows}
    workflow[_node_id(workflow, "WanVACESampler")]["inputs"]["context_windows"] = ["710", 0]
    return workflow, "710"


def _with_parallel(workflow: dict | None = None, **values) -> tuple[dict, str]:
    workflow = workflow or _t2v()
    parallel = {
        "devices": "cpu,cpu",
        "shard": "fsdp",
        "replicate_size": 1,
        "ulysses_degree": 1,
        "cfg_parallel": False,
        "launcher": "local",
        "endpoint": "127.0.0.1:29511",
        "timeout_s": 600.0,
        **values,
    }
    workflow["800"] = {"class_type": "WanVACEParallelOptions", "inputs": parallel}
    workflow[_node_id(workflow, "WanVACEModelLoader")]["inputs"]["parallel"] = ["800", 0]
    return workflow, "800"


# The option nodes no shipped workflow holds, attached to the text-to-video one.
_ATTACHED = {
    "WanVACECacheOptions": _with_cache,
    "WanVACEContextWindows": _with_windows,
    "WanVACEOffloadOptions": _with_offload,
    "WanVACEParallelOptions": _with_parallel,
}


def _workflow_holding(class_type: str) -> tuple[dict, str] | None:
    """A tiny-model workflow that holds a node of `class_type` (a shipped one, or t2v with the option node)."""
    if class_type in _ATTACHED:
        return _ATTACHED[class_type]()
    for path in sorted(API_DIR.glob("*.json")):
        workflow = for_tiny_model(json.loads(path.read_text()))
        found = [key for key, node in workflow.items() if node["class_type"] == class_type]
        if found:
            return workflow, min(found)
    return None


def _declared_ranges(server) -> dict[str, list[tuple[str, str, float, float]]]:
    """(input, INT/FLOAT, min, max) of every ranged widget of each of our nodes, from the server's /object_info."""
    ranges = {}
    for class_type, info in server.object_info().items():
        if not class_type.startswith("WanVACE"):
            continue
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
                if kind in ("INT", "FLOAT") and "min" in options and "max" in options:
                    ranges.setdefault(class_type, []).append((name, kind, options["min"], options["max"]))
    return ranges


def _bad_values(kind: str, low: float, high: float) -> list[float]:
    if kind == "INT":
        return [int(low) - 1, int(high) + 1]
    return [low - 1.0, high + 1.0, NAN]


@pytest.mark.every_variant
def test_every_declared_range_is_refused_once_under_its_input(comfy_server):
    """min - 1, max + 1 (and NaN for floats) of every ranged widget of every node of ours: refused at queue time, one
    error, under that input. Inputs a node validates itself skip ComfyUI's own range check, so each such node checks
    both bounds (context_length 1000001 once ran); the others keep ComfyUI's."""
    ranges = _declared_ranges(comfy_server)
    held = {class_type for class_type in ranges if _workflow_holding(class_type) is not None}
    # Every node of the graph's main path and every option node; a new node counts once a shipped workflow holds it.
    assert {
        "WanVACEModelLoader",
        "WanVACEExpertsLoader",
        "WanVACELoraLoader",
        "WanVACEConditioning",
        "WanVACESampler",
        "WanVACEDecode",
        "WanVACECacheOptions",
        "WanVACEContextWindows",
        "WanVACEOffloadOptions",
        "WanVACEParallelOptions",
    } - {"WanVACEModelLoader"} <= held
    print("ranged widgets of nodes no shipped workflow holds yet:", sorted(set(ranges) - held))
    failures, tried = [], 0
    for class_type, inputs in sorted(ranges.items()):
        if class_type not in held:
            continue
        for name, kind, low, high in inputs:
            for value in _bad_values(kind, low, high):
                workflow, node_id = _workflow_holding(class_type)
                workflow[node_id]["inputs"][name] = value
                code, body, _ = _post(comfy_server, workflow)
                tried += 1
                errors = [(nid, e) for nid, node in body.get("node_errors", {}).items() for e in node["errors"]]
                names = [(nid, e["extra_info"].get("input_name")) for nid, e in errors]
                if code != 400 or names != [(node_id, name)]:
                    failures.append(f"{class_type}.{name}={value}: HTTP {code}, errors under {names}")
    assert tried > 60, tried
    assert not failures, "\n".join(failures)


# ==================================================================================================
# Bad inputs against the features: refused once, under the input they are about, naming it


def _set(workflow_of, class_type: str, **values):
    def build() -> tuple[dict, str]:
        workflow = workflow_of()
        return _with(workflow, class_type, **values)

    return build


def _first_lora_with(**values):
    def build() -> tuple[dict, str]:
        workflow = _lightning()
        node_id = min(key for key, node in workflow.items() if node["class_type"] == "WanVACELoraLoader")
        workflow[node_id]["inputs"].update(values)
        return workflow, node_id

    return build


def _t2v_with(class_type: str, **values):
    return _set(_t2v, class_type, **values)


C, S, D = "WanVACEConditioning", "WanVACESampler", "WanVACEDecode"
BAD_INPUTS = [
    # (label, build -> (workflow, node id), input, fragment of the message)
    (
        "width not a multiple of 16",
        _t2v_with(C, width=65),
        "width",
        "width=65 is not a positive multiple of 16; use 64",
    ),
    ("height not a multiple of 16", _t2v_with(C, height=70), "height", "height=70 is not a positive multiple of 16"),
    ("length not 4n+1", _t2v_with(C, length=80), "length", "length=80 frames is not of the form 4n+1"),
    ("length far too long", _t2v_with(C, length=100001), "length", "length=100001 is outside its range 1 to 1025"),
    (
        "the shipped 832x480 on the tiny model",
        _t2v_with(C, width=832, height=480, length=81),
        "width",
        "width=832 is more than this model can run: its rope_max_seq_len 32",
    ),
    ("a height the tiny model cannot run", _t2v_with(C, height=528), "height", "can be at most 512; use 512 or less"),
    (
        "a length the tiny model cannot run",
        _t2v_with(C, length=161),
        "length",
        "length=161 gives 41 latent frames per transformer call",
    ),
    ("empty prompt", _t2v_with(C, positive="  "), "positive", "positive prompt is empty"),
    (
        "VACE window reversed",
        _t2v_with(C, vace_start_percent=0.8, vace_end_percent=0.2),
        "vace_start_percent",
        "vace_start_percent=0.8 is after vace_end_percent=0.2",
    ),
    ("VACE end NaN", _t2v_with(C, vace_end_percent=NAN), "vace_end_percent", "vace_end_percent=nan is not a finite"),
    ("tile overlap not below the tile", _t2v_with(C, tile_overlap=256), "tile_overlap", "below tile_size=256"),
    ("tiling mode unknown", _t2v_with(D, tiled="sometimes"), "tiled", "tiled='sometimes' is not a tiling mode"),
    ("decode tile not a multiple of 8", _t2v_with(D, tile_size=250), "tile_size", "tile_size=250 is not a multiple"),
    ("scheduler unknown", _t2v_with(S, scheduler="ddim"), "scheduler", "scheduler='ddim' is unknown"),
    ("model not installed", _t2v_with("WanVACEModelLoader", model_name="x"), "model_name", "model_name='x' is not in"),
    ("attention unknown", _t2v_with("WanVACEModelLoader", attention="fastest"), "attention", "attention='fastest'"),
    (
        "expert not installed",
        _set(lambda: _i2v_fp8(), "WanVACEExpertsLoader", low_noise_model="x.safetensors"),
        "low_noise_model",
        "low_noise_model='x.safetensors' is not in ComfyUI's models/diffusion_models folder",
    ),
    (
        "window not 4n+1",
        lambda: _with_windows(context_length=18),
        "context_length",
        "context_length=18 must be 4n+1",
    ),
    (
        "window far too long",
        lambda: _with_windows(context_length=1000001),
        "context_length",
        "context_length=1000001 is outside its range 5 to 1025",
    ),
    (
        "overlap not a multiple of 4",
        lambda: _with_windows(context_overlap=18),
        "context_overlap",
        "context_overlap=18 must be a multiple of 4",
    ),
    (
        "overlap as long as the window",
        lambda: _with_windows(context_length=17, context_overlap=16),
        "context_overlap",
        "context_overlap=16 must be less than context_length - 1",
    ),
    ("stride above 8", lambda: _with_windows(context_stride=9), "context_stride", "Value 9 bigger than max of 8"),
    ("schedule unknown", lambda: _with_windows(schedule="random"), "schedule", "schedule='random' is unknown"),
    ("fuse unknown", lambda: _with_windows(fuse_method="mean"), "fuse_method", "fuse_method='mean' is unknown"),
    (
        "a window the tiny model cannot run",
        lambda: _with_windows(_with(_t2v(), C, length=241)[0], context_length=161, context_overlap=16),
        "context_length",
        "context_length=161 gives 41 latent frames per window",
    ),
    (
        "the cache with moving windows",
        lambda: _with_windows(_with_cache(_with(_t2v(), C, length=33)[0])[0], schedule="standard_uniform"),
        "schedule",
        "the cache needs context windows with schedule standard_static, not 'standard_uniform'",
    ),
    ("cache mode unknown", lambda: _with_cache(mode="FBCache"), "mode", "mode='FBCache' is unknown"),
    ("cache threshold NaN", lambda: _with_cache(residual_diff_threshold=NAN), "residual_diff_threshold", "nan"),
    (
        "LoRA not installed",
        _first_lora_with(lora_name="x.safetensors"),
        "lora_name",
        "lora_name='x.safetensors' is not in ComfyUI's models/loras folder",
    ),
    (
        "LoRA strength NaN",
        _first_lora_with(strength_low_noise=NAN),
        "strength_low_noise",
        "nan",
    ),
    ("offload mode unknown", lambda: _with_offload(mode="sequential"), "mode", "mode='sequential' is unknown"),
    ("offload prefetch above 16", lambda: _with_offload(prefetch_blocks=17), "prefetch_blocks", "Value 17 bigger"),
    ("parallel GPUs not there", lambda: _with_parallel(devices="cuda:0,cuda:1"), "devices", "this machine has 0 GPU"),
    ("parallel no devices", lambda: _with_parallel(devices=""), "devices", "devices is empty"),
    (
        "ulysses not dividing",
        lambda: _with_parallel(ulysses_degree=3),
        "ulysses_degree",
        "ulysses_degree=3 must divide",
    ),
    (
        "replicate without hsdp",
        lambda: _with_parallel(replicate_size=2),
        "replicate_size",
        "only applies to shard=hsdp",
    ),
    ("shard unknown", lambda: _with_parallel(shard="zero3"), "shard", "shard='zero3' is unknown"),
    ("launcher unknown", lambda: _with_parallel(launcher="mpirun"), "launcher", "launcher='mpirun' is unknown"),
    (
        "CFG parallel on an odd count",
        lambda: _with_parallel(devices="cpu,cpu,cpu", cfg_parallel=True),
        "cfg_parallel",
        "cfg_parallel needs an even number of devices",
    ),
    (
        "torchrun endpoint not host:port",
        lambda: _with_parallel(launcher="torchrun", endpoint="nonsense"),
        "endpoint",
        "endpoint='nonsense' is not host:port",
    ),
]


@pytest.mark.every_variant
@pytest.mark.parametrize(("label", "build", "name", "fragment"), BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_a_bad_input_is_refused_once_under_its_input(label, build, name, fragment, comfy_server):
    workflow, node_id = build()
    _refused_once(comfy_server, workflow, node_id, name, fragment)


def test_a_merged_lora_over_sharded_workers_is_refused_under_each_merge(comfy_server):
    """LoRAs run on parallel workers; merged into sharded experts they cannot (each rank holds a shard of a weight)."""
    workflow, _ = _with_parallel(_lightning())  # shard fsdp
    loras = sorted(key for key, node in workflow.items() if node["class_type"] == "WanVACELoraLoader")
    for node_id in loras:
        workflow[node_id]["inputs"]["merge"] = True
    code, body, _ = _post(comfy_server, workflow)
    assert code == 400, body
    assert sorted(body["node_errors"]) == loras
    for node_id in loras:
        (error,) = body["node_errors"][node_id]["errors"]
        assert error["extra_info"]["input_name"] == "merge", error
        assert "merge=True: the loader's WanVACE Parallel Options shard the experts (shard=fsdp)" in error["details"]
        assert "set merge off" in error["details"], error


def test_a_width_through_comfyuis_primitive_node_is_checked_against_the_model(comfy_server):
    # Workflows that set the size once feed it from a primitive node; its value is known when the prompt is queued.
    workflow = _t2v()
    conditioning = _node_id(workflow, C)
    workflow["900"] = {"class_type": "PrimitiveInt", "inputs": {"value": 832}}
    workflow[conditioning]["inputs"]["width"] = ["900", 0]
    _refused_once(comfy_server, workflow, conditioning, "width", "width=832 is more than this model can run")


@pytest.mark.every_variant
@pytest.mark.parametrize(
    ("linked", "value", "widgets"),
    [
        # 96 frames of overlap fit a 129-frame window, not the default 81 a linked length was taken for.
        ("context_length", 129, {"context_overlap": 96}),
        # A 17-frame window fits an 8-frame overlap, not the default 16 a linked overlap was taken for.
        ("context_overlap", 8, {"context_length": 17}),
    ],
)
def test_a_linked_window_setting_is_not_taken_for_its_default(linked, value, widgets, comfy_server):
    # ComfyUI passes a linked input to validate_inputs as None; its value is known when the prompt runs.
    workflow, node_id = _with_windows(**widgets)
    workflow["901"] = {"class_type": "PrimitiveInt", "inputs": {"value": value}}
    workflow[node_id]["inputs"][linked] = ["901", 0]
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", (result.status, result.response, result.error)


def test_a_linked_offload_mode_runs_and_an_unknown_one_fails_naming_it(comfy_server):
    # The mode picked by ComfyUI's If/Else Switch: validate_inputs gets None, the value arrives when the node runs.
    if "ComfySwitchNode" not in comfy_server.object_info():
        pytest.skip("this ComfyUI has no If/Else Switch node (ComfySwitchNode)")
    for mode, succeeds in (("layerwise", True), ("everywhere", False)):
        workflow, node_id = _with_offload()
        workflow["903"] = {
            "class_type": "ComfySwitchNode",
            "inputs": {"switch": True, "on_true": mode, "on_false": "none"},
        }
        workflow[node_id]["inputs"]["mode"] = ["903", 0]
        result = comfy_server.run_prompt(workflow, timeout=600)
        if succeeds:
            assert result.status == "success", (result.status, result.response, result.error)
        else:
            assert result.status == "error", (result.status, result.response)
            assert "mode='everywhere'" in json.dumps(result.error), result.error


def test_a_linked_attention_and_compile_are_probed_when_the_loader_runs(comfy_server):
    if "ComfySwitchNode" not in comfy_server.object_info():
        pytest.skip("this ComfyUI has no If/Else Switch node (ComfySwitchNode)")
    workflow, node_id = _with(_t2v(), "WanVACEModelLoader")
    workflow["904"] = {
        "class_type": "ComfySwitchNode",
        "inputs": {"switch": True, "on_true": "native", "on_false": "auto"},
    }
    workflow["905"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": False, "on_true": True, "on_false": False}}
    workflow[node_id]["inputs"].update(attention=["904", 0], compile=["905", 0])
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", (result.status, result.response, result.error)


def test_a_linked_tile_size_is_not_taken_for_its_default(comfy_server):
    # A 296 px overlap fits the linked 512 px tile, not the default 256 px tile a linked tile_size was taken for.
    workflow, node_id = _with(_t2v(), "WanVACEDecode", tiled="on", tile_overlap=296)
    workflow["902"] = {"class_type": "PrimitiveInt", "inputs": {"value": 512}}
    workflow[node_id]["inputs"]["tile_size"] = ["902", 0]
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", (result.status, result.response, result.error)


@pytest.mark.every_variant
def test_model_default_widgets_say_so_on_the_node_and_old_prompts_keep_their_values(comfy_server):
    info = comfy_server.object_info("WanVACESampler")["WanVACESampler"]["input"]["required"]
    assert info["boundary_ratio"][1]["display_name"] == "boundary_ratio (-1 = model's)"
    assert info["shift"][1]["display_name"] == "shift (0 = model's)"
    assert (info["boundary_ratio"][1]["default"], info["shift"][1]["default"]) == (-1.0, 0.0)
    cache = comfy_server.object_info("WanVACECacheOptions")["WanVACECacheOptions"]["input"]["required"]
    assert cache["max_cached_steps"][1]["display_name"] == "max_cached_steps (-1 = no limit)"
    # A saved prompt names inputs by id, never by label: -1 and 0 still mean the model's values.
    workflow, _ = _with(_t2v(), S, boundary_ratio=-1.0, shift=0.0, seed=4242)
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", (result.error, result.response)


def test_reference_images_that_leave_the_video_too_few_frames_are_refused_when_the_conditioning_runs(comfy_server):
    # Their count is not known when the prompt is queued (an IMAGE batch from other nodes): 121 frames are 31 latent
    # frames, which the tiny model runs alone, but not beside the workflow's 2 reference images (33 > 32). The
    # conditioning node refuses before it encodes anything, naming the length that fits.
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_r2v.json").read_text()))
    workflow, node_id = _with(workflow, C, length=121)
    result = comfy_server.run_prompt(workflow, timeout=300)
    assert result.status == "error", (result.status, result.response)
    assert result.error["node_id"] == node_id, result.error
    assert result.error["exception_type"] == "WanVACEInputError"
    assert result.error["exception_message"].startswith(
        "length=121 gives 31 latent frames plus 2 reference frame(s) per transformer call"
    ), result.error
    assert "use length 117 or less beside 2 reference image(s)" in result.error["exception_message"]


def _with_guidance(**values) -> tuple[dict, str]:
    workflow = _t2v()
    guidance = {**LIGHTNING_NAG, "nag_scale": 1.0, **values}
    workflow["710"] = {"class_type": "WanVACEGuidanceOptions", "inputs": guidance}
    workflow[_node_id(workflow, "WanVACESampler")]["inputs"]["guidance"] = ["710", 0]
    return workflow, "710"


@pytest.mark.parametrize(
    ("values", "name", "fragment"),
    [
        ({"rule": "pag"}, "rule", "rule='pag' is unknown; choose one of cfg"),
        ({"experts": "middle"}, "experts", "experts='middle' is unknown"),
        ({"slg_blocks": "9, x"}, "slg_blocks", "slg_blocks='9, x' must list block indices"),
        ({"slg_blocks": "9", "slg_start_percent": 0.8, "slg_end_percent": 0.2}, "slg_start_percent", "swap them"),
        ({"slg_blocks": "9", "slg_end_percent": NAN}, "slg_end_percent", "slg_end_percent=nan must lie in [0, 1]"),
        ({"nag_tau": 1.0}, "nag_tau", "Value 1.0 smaller than min of 1.01"),
        ({"apg_momentum": NAN}, "apg_momentum", "Value nan smaller than min of -1.0"),
    ],
)
def test_bad_guidance_options_are_refused_once_under_their_input(values, name, fragment, comfy_server):
    workflow, node_id = _with_guidance(**values)
    _refused_once(comfy_server, workflow, node_id, name, fragment)
