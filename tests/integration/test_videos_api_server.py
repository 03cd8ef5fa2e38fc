"""vLLM-Omni's videos API on a real ComfyUI (both versions), as the recipe's clients call it: multipart fields as
`curl -F` sends them, the tiny model in place of the real one.

The API's server runs with `WANVACE_API_MODEL` set (the documented default) and `--max-upload-size 1` (so the upload
limit is tested with a 1 MiB file); the suite's shared server has no default model.
"""

from __future__ import annotations

import io
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
from comfy_server import ComfyServer, require_comfyui
from workflow_graphs import TINY_MODEL, for_tiny_model, node_id_of

from tests.vace_tasks import lossless_video

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
WIDTH, HEIGHT, FRAMES = 64, 48, 9
FIELDS = {
    "prompt": "a small blue bird takes off from a branch",
    "negative_prompt": "blurry",
    "width": "64",
    "height": "48",
    "num_frames": "9",
    "fps": "16",
    "num_inference_steps": "3",
    "guidance_scale": "4.0",
    "guidance_scale_2": "5.0",
    "seed": "7",
}


@pytest.fixture(scope="module")
def api_server(comfy_base, tmp_path_factory):
    require_comfyui()
    server = ComfyServer(
        tmp_path_factory.mktemp("videos_api"),
        models_from=comfy_base,
        extra_args=["--max-upload-size", "1"],
        env={"WANVACE_API_MODEL": TINY_MODEL},
    )
    server.prepare()
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()


def _form(**fields) -> dict:
    """requests' `files=` form of plain fields: multipart/form-data, as `curl -F name=value` sends it."""
    return {name: (None, str(value)) for name, value in fields.items()}


def _png_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _frames(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _assert_same_images(workflow: dict, result) -> None:
    """The job queued through /prompt computed nothing itself: ComfyUI served every node but its new SaveVideo from
    its output cache, filled by the API's job. So the API's job was that workflow node for node, with the same inputs,
    and its images are the same tensors.

    The MP4s are not compared: ComfyUI's SaveVideo does not always encode the same images to the same MP4 (both
    versions, libx264 through PyAV). Measured: the same cached video saved twice by one server had equal packets up
    to frame 3 and different ones after it in 1 run of 4, 0.84 levels apart on average; SaveImage of the same
    images was bitwise equal every time."""
    saver = node_id_of(workflow, "SaveVideo")
    assert sorted(result.cached_nodes()) == sorted(node for node in workflow if node != saver)


def _saved_video(server: ComfyServer, result) -> bytes:
    (path,) = [path for path in result.output_files() if path.suffix == ".mp4"]
    return path.read_bytes()


def _same_job_through_prompt(server: ComfyServer, task: str, prefix: str, image: str | None = None):
    """The shipped workflow with FIELDS' values, queued through /prompt as the graph editor would: the workflow and
    its result."""
    workflow = for_tiny_model(json.loads((API_DIR / f"wanvace_{task}.json").read_text()))
    conditioning = workflow[node_id_of(workflow, "WanVACEConditioning")]["inputs"]
    conditioning.update(positive=FIELDS["prompt"], negative=FIELDS["negative_prompt"])
    sampler = workflow[node_id_of(workflow, "WanVACESampler")]["inputs"]
    sampler.update(seed=7, steps=3, cfg=5.0, cfg_low_noise=4.0)
    workflow[node_id_of(workflow, "SaveVideo")]["inputs"]["filename_prefix"] = prefix
    if image is not None:
        workflow[node_id_of(workflow, "LoadImage")]["inputs"]["image"] = image
    result = server.run_prompt(workflow)
    assert result.status == "success", (result.status, result.error)
    return workflow, result


def _wait(server: ComfyServer, video_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = server.get(f"/v1/videos/{video_id}").json()
        if record["status"] in ("completed", "failed"):
            return record
        time.sleep(0.1)
    raise AssertionError(f"{video_id} did not finish in {timeout} s: {record}")


def _temp_files(server: ComfyServer) -> list[Path]:
    folder = server.base_dir / "temp" / "wanvace_api"
    return sorted(path for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else []


# --- sync, async, list, delete -------------------------------------------------------------------------------


def test_sync_returns_the_mp4_and_equals_the_same_job_through_prompt(api_server):
    answer = api_server.http.post(f"{api_server.url}/v1/videos/sync", files=_form(**FIELDS), timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"] == "video/mp4"
    frames = _frames(answer.content)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    workflow, result = _same_job_through_prompt(api_server, "t2v", "videos_api/t2v_prompt")
    _assert_same_images(workflow, result)
    assert _frames(_saved_video(api_server, result)).shape == frames.shape
    video_id = answer.headers["X-Video-Id"]
    record = api_server.get(f"/v1/videos/{video_id}").json()
    assert (record["status"], record["progress"], record["size"], record["object"]) == (
        "completed",
        100,
        "64x48",
        "video",
    )
    # The job was a prompt of ComfyUI's own queue: it is in ComfyUI's history.
    history = api_server.get("/history").json()
    assert any(entry["prompt"][3].get("wanvace_video") == video_id for entry in history.values())
    assert _temp_files(api_server) == []


def test_an_image_upload_runs_image_to_video_and_equals_the_same_job_through_prompt(api_server):
    image = _png_bytes(3)
    files = {**_form(**FIELDS), "input_reference": ("first.png", image, "image/png")}
    answer = api_server.http.post(f"{api_server.url}/v1/videos/sync", files=files, timeout=300)
    assert answer.status_code == 200, answer.text
    assert _frames(answer.content).shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert _temp_files(api_server) == []  # the upload went with the job
    # The job loaded its upload from its own temp folder; the same image put back under that name loads the same.
    video_id = answer.headers["X-Video-Id"]
    history = api_server.get("/history").json()
    (job,) = [entry["prompt"][2] for entry in history.values() if entry["prompt"][3].get("wanvace_video") == video_id]
    name = job[node_id_of(job, "LoadImage")]["inputs"]["image"]
    upload = api_server.base_dir / "temp" / name.removesuffix(" [temp]")
    upload.parent.mkdir(parents=True)
    upload.write_bytes(image)
    try:
        workflow, result = _same_job_through_prompt(api_server, "i2v", "videos_api/i2v_prompt", image=name)
    finally:
        shutil.rmtree(upload.parent)
    _assert_same_images(workflow, result)


def test_async_create_poll_content_list_and_delete(api_server):
    created = api_server.http.post(f"{api_server.url}/v1/videos", files=_form(**{**FIELDS, "seed": "8"}), timeout=60)
    assert created.status_code == 200, created.text
    record = created.json()
    assert record["status"] in ("queued", "in_progress") and record["id"].startswith("video_")
    done = _wait(api_server, record["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    assert done["media_type"] == "video/mp4"
    content = api_server.get(f"/v1/videos/{record['id']}/content")
    assert content.status_code == 200 and _frames(content.content).shape == (FRAMES, HEIGHT, WIDTH, 3)
    listed = api_server.get("/v1/videos").json()
    assert listed["object"] == "list" and record["id"] in [job["id"] for job in listed["data"]]
    deleted = api_server.http.delete(f"{api_server.url}/v1/videos/{record['id']}").json()
    assert deleted == {"id": record["id"], "object": "video.deleted", "deleted": True}
    assert api_server.get(f"/v1/videos/{record['id']}").status_code == 404
    assert list((api_server.base_dir / "output" / "wanvace_api").glob(f"{record['id']}*")) == []


def _long_job(server: ComfyServer, seed: int) -> str:
    fields = {**FIELDS, "num_inference_steps": "200", "num_frames": "33", "seed": str(seed)}
    answer = server.http.post(f"{server.url}/v1/videos", files=_form(**fields), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def test_delete_stops_a_running_job_and_removes_a_queued_one(api_server):
    running, queued = _long_job(api_server, 21), _long_job(api_server, 22)
    deadline = time.monotonic() + 60
    while api_server.get(f"/v1/videos/{running}").json()["progress"] < 1:
        assert time.monotonic() < deadline, "the long job never made progress"
        time.sleep(0.05)
    assert api_server.get(f"/v1/videos/{queued}").json()["status"] == "queued"
    assert api_server.http.delete(f"{api_server.url}/v1/videos/{queued}").json()["deleted"] is True
    pending = [item[1] for item in api_server.queue_state()["queue_pending"]]
    assert len(pending) == 0, pending
    stopped_at = api_server.get(f"/v1/videos/{running}").json()["progress"]
    assert api_server.http.delete(f"{api_server.url}/v1/videos/{running}").json()["deleted"] is True
    api_server.wait_idle(timeout=60)
    # It stopped long before its 200 steps: ComfyUI recorded the interruption, and no video was saved.
    interrupted = [
        entry
        for entry in api_server.get("/history").json().values()
        if entry["prompt"][3].get("wanvace_video") == running
    ]
    assert len(interrupted) == 1 and interrupted[0]["status"]["status_str"] == "error"
    assert any(kind == "execution_interrupted" for kind, _ in interrupted[0]["status"]["messages"])
    assert stopped_at < 100
    assert list((api_server.base_dir / "output" / "wanvace_api").glob(f"{running}*")) == []
    assert _temp_files(api_server) == []


# --- errors ------------------------------------------------------------------------------------------------


def _error_of(answer) -> tuple[int, str | None, str]:
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return answer.status_code, body["error"]["param"], body["error"]["message"]


@pytest.mark.every_variant
@pytest.mark.parametrize(
    ("extra", "status", "param", "fragment"),
    [
        ({"quality": "high"}, 400, "quality", "unknown field 'quality'"),
        ({"width": "70"}, 400, "width", "width=70 is not a positive multiple of 16; use 64"),
        ({"num_frames": "10"}, 400, "num_frames", "num_frames=10 is not of the form 4n+1"),
        ({"num_frames": "nine"}, 400, "num_frames", "is not a whole number"),
        ({"video_reference": "https://example.com/a.mp4"}, 400, "video_reference", "never fetches URLs"),
        ({"video_reference": "data:video/mp4;base64,!!!"}, 400, "video_reference", "not valid base64"),
        ({"model": "no-such-model"}, 404, "model", "model 'no-such-model' is not listed"),
        ({"extra_params": '{"colour": 1}'}, 400, "extra_params.colour", "unknown keys ['colour']"),
        ({"extra_params": '{"mode": "inpaint"}'}, 400, "input_reference", "needs input_reference (a video)"),
        ({"lora": "missing.safetensors"}, 400, "lora", "WanVACELoraLoader"),
    ],
)
def test_bad_fields_are_refused_in_the_openai_error_shape_naming_the_field(api_server, extra, status, param, fragment):
    answer = api_server.http.post(f"{api_server.url}/v1/videos", files=_form(**{**FIELDS, **extra}), timeout=60)
    got_status, got_param, message = _error_of(answer)
    assert (got_status, got_param) == (status, param), message
    assert fragment in message, message
    assert _temp_files(api_server) == []


def test_bad_uploads_are_refused_naming_the_field(api_server):
    both = {
        **_form(**FIELDS, video_reference="data:video/mp4;base64,AAAA"),
        "input_reference": ("first.png", _png_bytes(1), "image/png"),
    }
    status, param, message = _error_of(api_server.http.post(f"{api_server.url}/v1/videos", files=both, timeout=60))
    assert (status, param) == (400, "video_reference") and "cannot both be given" in message
    unreadable = {**_form(**FIELDS), "input_reference": ("notes.txt", b"hello, not a picture", "text/plain")}
    status, param, message = _error_of(
        api_server.http.post(f"{api_server.url}/v1/videos", files=unreadable, timeout=60)
    )
    assert (status, param) == (400, "input_reference") and "not a readable image or video" in message
    too_large = {**_form(**FIELDS), "input_reference": ("big.png", b"\x89PNG" + bytes(2 * 1024 * 1024), "image/png")}
    status, param, message = _error_of(api_server.http.post(f"{api_server.url}/v1/videos", files=too_large, timeout=60))
    assert (status, param) == (413, "input_reference") and "upload limit" in message
    # The limit is the request's, as ComfyUI's is: two parts under it each are refused together.
    halves = {
        **_form(**{**FIELDS, "prompt": "a bird " * (100 * 1024)}),
        "input_reference": ("half.png", b"\x89PNG" + bytes(600 * 1024), "image/png"),
    }
    status, param, message = _error_of(api_server.http.post(f"{api_server.url}/v1/videos", files=halves, timeout=60))
    assert (status, param) == (413, "input_reference") and "takes the request over" in message
    assert _temp_files(api_server) == []


def test_unknown_job_ids_are_404(api_server):
    for method, path in (("get", ""), ("get", "/content"), ("delete", "")):
        answer = getattr(api_server.http, method)(f"{api_server.url}/v1/videos/video_nope{path}")
        assert _error_of(answer)[:2] == (404, "video_id")


def test_without_a_default_model_a_request_without_model_is_refused_listing_the_models(comfy_server):
    answer = comfy_server.http.post(f"{comfy_server.url}/v1/videos", files=_form(**FIELDS), timeout=60)
    status, param, message = _error_of(answer)
    assert (status, param) == (400, "model") and TINY_MODEL in message and "WANVACE_API_MODEL" in message


# --- many clients ------------------------------------------------------------------------------------------


def test_four_clients_and_a_graph_editor_prompt_all_complete_in_queue_order_with_nothing_left(api_server):
    results: dict[str, object] = {}

    def sync_client(name: str, seed: int) -> None:
        answer = api_server.http.post(
            f"{api_server.url}/v1/videos/sync", files=_form(**{**FIELDS, "seed": str(seed)}), timeout=300
        )
        results[name] = (answer.status_code, answer.headers.get("X-Video-Id"), len(_frames(answer.content)))

    def async_client(name: str, seed: int) -> None:
        created = api_server.http.post(
            f"{api_server.url}/v1/videos", files=_form(**{**FIELDS, "seed": str(seed)}), timeout=60
        ).json()
        record = _wait(api_server, created["id"])
        content = api_server.get(f"/v1/videos/{created['id']}/content")
        results[name] = (record["status"], created["id"], len(_frames(content.content)))

    clients = [
        threading.Thread(target=sync_client, args=("sync1", 31)),
        threading.Thread(target=async_client, args=("async1", 32)),
        threading.Thread(target=sync_client, args=("sync2", 33)),
        threading.Thread(target=async_client, args=("async2", 34)),
    ]
    for client in clients[:2]:
        client.start()
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()), seed=35, steps=3)
    workflow[node_id_of(workflow, "SaveVideo")]["inputs"]["filename_prefix"] = "videos_api/editor"
    editor = api_server.run_prompt(workflow)
    for client in clients[2:]:
        client.start()
    for client in clients:
        client.join(timeout=300)
    assert editor.status == "success"
    assert results["sync1"][0] == results["sync2"][0] == 200
    assert results["async1"][0] == results["async2"][0] == "completed"
    assert all(result[2] == FRAMES for result in results.values())
    # ComfyUI ran the five prompts one after another in the order they were queued (their queue numbers).
    history = api_server.get("/history").json()
    ids = {result[1] for result in results.values()}
    entries = [
        entry
        for prompt_id, entry in history.items()
        if entry["prompt"][3].get("wanvace_video") in ids or prompt_id == editor.prompt_id
    ]
    assert len(entries) == 5 and all(entry["status"]["status_str"] == "success" for entry in entries)

    def started(entry) -> int:
        return next(data["timestamp"] for kind, data in entry["status"]["messages"] if kind == "execution_start")

    by_number = sorted(entries, key=lambda entry: entry["prompt"][0])
    assert [started(entry) for entry in by_number] == sorted(started(entry) for entry in entries)
    assert _temp_files(api_server) == []


def test_memory_stays_flat_over_twenty_jobs(api_server):
    def job(seed: int) -> None:
        answer = api_server.http.post(
            f"{api_server.url}/v1/videos/sync", files=_form(**{**FIELDS, "seed": str(seed)}), timeout=300
        )
        assert answer.status_code == 200, answer.text

    for seed in range(100, 105):
        job(seed)
    before = api_server.memory()["VmRSS"]
    for seed in range(105, 125):
        job(seed)
    after = api_server.memory()["VmRSS"]
    growth = (after - before) / 2**20
    print(f"server RSS over 20 jobs: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB ({growth:+.1f} MiB)")
    assert growth < 64, f"RSS grew {growth:.1f} MiB over 20 jobs"
    assert _temp_files(api_server) == []


# --- the README's commands, as written ---------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
# The README's values for the real model, and the tiny model's.
TINY_VALUES = {
    "http://127.0.0.1:8188": None,  # the test server's address
    "width=832": "width=64",
    "height=480": "height=48",
    "size=832x480": "size=64x48",
    "num_frames=81": "num_frames=9",
    "num_inference_steps=30": "num_inference_steps=2",
}


def _readme_client_commands() -> str:
    section = README.read_text().split("## Videos API")[1].split("\n## ")[0]
    blocks = section.split("```bash\n")[1:]
    (commands,) = [block.split("```")[0] for block in blocks if "curl" in block]
    return commands


def test_the_readme_curl_commands_run_as_written(api_server, tmp_path):
    import shutil
    import subprocess

    if shutil.which("curl") is None or shutil.which("jq") is None:
        pytest.skip("SKIPPED: the README's commands need curl and jq")
    commands = _readme_client_commands()
    for real, tiny in TINY_VALUES.items():
        assert real in commands, f"the README's commands no longer hold {real!r}"
        commands = commands.replace(real, tiny or api_server.url)
    (tmp_path / "first.png").write_bytes(_png_bytes(9))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    for name in ("t2v.mp4", "i2v.mp4"):
        frames = _frames((tmp_path / name).read_bytes())
        assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3), name
    lines = done.stdout.splitlines()
    assert json.loads(lines[-1])["deleted"] is True
    assert _temp_files(api_server) == []


# --- the VACE extras, and ComfyUI's Cancel ---------------------------------------------------------------------


def _data_uri(data: bytes, media_type: str) -> str:
    import base64

    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _mask_uri() -> str:
    pixels = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
    pixels[8:32, 16:48] = 255
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return _data_uri(buffer.getvalue(), "image/png")


@pytest.mark.parametrize(
    ("extra", "fields"),
    [
        ({"mode": "flf2v", "last_image": _data_uri(_png_bytes(12), "image/png")}, {"image": True}),
        ({"mode": "inpaint", "mask": _mask_uri()}, {"video": FRAMES}),
        ({"mode": "outpaint", "outpaint": {"left": 16, "right": 16}}, {"video": FRAMES, "width": 32}),
        ({"mode": "extension", "given_frames": 5}, {"video": 5}),
        ({"mode": "v2v", "strength": 0.8, "vace_end_percent": 0.5, "scheduler": "euler"}, {"video": FRAMES}),
    ],
    ids=["flf2v", "inpaint", "outpaint", "extension", "v2v"],
)
def test_extra_params_run_every_vace_mode(api_server, extra, fields):
    form = _form(**FIELDS, extra_params=json.dumps(extra))
    if fields.get("image"):
        form["input_reference"] = ("first.png", _png_bytes(11), "image/png")
    if "video" in fields:
        video = lossless_video(fields["video"], 13, width=fields.get("width", WIDTH))
        form["video_reference"] = (None, _data_uri(video, "video/quicktime"))
    answer = api_server.http.post(f"{api_server.url}/v1/videos/sync", files=form, timeout=300)
    assert answer.status_code == 200, answer.text
    assert _frames(answer.content).shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert _temp_files(api_server) == []


def test_reference_images_cache_and_context_windows_reach_the_sampler(api_server):
    extra = {
        "mode": "r2v",
        "reference_images": [_data_uri(_png_bytes(seed), "image/png") for seed in (14, 15)],
        "cache": {"mode": "DBCache+TaylorSeer", "residual_diff_threshold": 0.3, "max_warmup_steps": 1},
        "context_windows": {"context_length": 17, "context_overlap": 8},
    }
    fields = {**FIELDS, "num_frames": "33", "num_inference_steps": "6", "extra_params": json.dumps(extra)}
    answer = api_server.http.post(f"{api_server.url}/v1/videos/sync", files=_form(**fields), timeout=300)
    assert answer.status_code == 200, answer.text
    assert _frames(answer.content).shape[0] == 33
    video_id = answer.headers["X-Video-Id"]
    (entry,) = [
        e for e in api_server.get("/history").json().values() if e["prompt"][3].get("wanvace_video") == video_id
    ]
    prompt = entry["prompt"][2]
    assert sum(node["class_type"] == "LoadImage" for node in prompt.values()) == 2
    report = json.dumps(entry["outputs"])
    # The sampler's cache report: TaylorSeer ran, on each of the three windows.
    assert "TaylorSeer (order 1)" in report and "(3 windows)" in report, report


def test_comfyuis_cancel_fails_the_job_as_cancelled_and_the_next_job_runs(api_server):
    video_id = _long_job(api_server, 41)
    deadline = time.monotonic() + 60
    while api_server.get(f"/v1/videos/{video_id}").json()["progress"] < 1:
        assert time.monotonic() < deadline, "the long job never made progress"
        time.sleep(0.05)
    api_server.interrupt()  # what the graph editor's Cancel sends
    record = _wait(api_server, video_id)
    assert record["status"] == "failed" and record["error"]["code"] == "cancelled", record
    assert api_server.get(f"/v1/videos/{video_id}/content").status_code == 404
    answer = api_server.http.post(f"{api_server.url}/v1/videos/sync", files=_form(**FIELDS), timeout=300)
    assert answer.status_code == 200
    assert _temp_files(api_server) == []


def test_a_single_file_set_named_in_the_settings_file_is_a_model(api_server):
    shipped = json.loads((API_DIR / "wanvace_i2v_fp8.json").read_text())
    loader = shipped[node_id_of(shipped, "WanVACEExpertsLoader")]["inputs"]
    files = {name: loader[name] for name in ("high_noise_model", "low_noise_model", "text_encoder", "vae")}
    settings = api_server.base_dir / "user" / "wanvace_videos_api.json"
    broken = {**files, "vae": "no_such_vae.safetensors"}
    settings.write_text(json.dumps({"single_file_models": {"tiny-fp8-files": files, "broken-files": broken}}))
    try:
        answer = api_server.http.post(
            f"{api_server.url}/v1/videos/sync", files=_form(**FIELDS, model="tiny-fp8-files"), timeout=300
        )
        assert answer.status_code == 200, answer.text
        assert _frames(answer.content).shape == (FRAMES, HEIGHT, WIDTH, 3)
        video_id = answer.headers["X-Video-Id"]
        (entry,) = [
            e for e in api_server.get("/history").json().values() if e["prompt"][3].get("wanvace_video") == video_id
        ]
        assert [node["class_type"] for node in entry["prompt"][2].values()].count("WanVACEExpertsLoader") == 1
        refused = api_server.http.post(f"{api_server.url}/v1/videos", files=_form(**FIELDS, model="broken-files"))
        status, param, message = _error_of(refused)
        assert (status, param) == (400, "model") and "no_such_vae.safetensors" in message, message
        unknown = api_server.http.post(f"{api_server.url}/v1/videos", files=_form(**FIELDS, model="nope"))
        status, param, message = _error_of(unknown)
        assert (status, param) == (404, "model") and "tiny-fp8-files" in message and TINY_MODEL in message
    finally:
        settings.unlink()
    assert _temp_files(api_server) == []
