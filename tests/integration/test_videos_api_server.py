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

from bench.rss import read_status
from scripts.comfy_server import ComfyServer
from tests.support.api_graphs import node_id_of
from tests.support.comfyui import require_comfyui
from tests.support.vace_tasks import lossless_video
from workflow_graphs import TINY_MODEL, for_tiny_model

pytestmark = [
    pytest.mark.integration,
    # The official SDK marks its videos methods deprecated (OpenAI's Sora API shuts down); they still work here.
    pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning"),
]

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
    videos = api_server.base_dir / "output" / "wanvace_api"
    assert list(videos.glob(f"{record['id']}*")) == list(videos.glob(f".jobs/{record['id']}*")) == []


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
        ({"lora": "missing.safetensors"}, 400, "lora", "missing.safetensors"),
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
    before = read_status(api_server.proc.pid)["VmRSS"]
    for seed in range(105, 125):
        job(seed)
    after = read_status(api_server.proc.pid)["VmRSS"]
    growth = (after - before) / 2**20
    print(f"server RSS over 20 jobs: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB ({growth:+.1f} MiB)")
    assert growth < 64, f"RSS grew {growth:.1f} MiB over 20 jobs"
    assert _temp_files(api_server) == []


# --- the docs' commands, as written -----------------------------------------------------------------------

VIDEOS_API_DOC = Path(__file__).resolve().parents[2] / "docs" / "videos-api.md"
# The docs' values for the real model, and the tiny model's.
TINY_VALUES = {
    "http://127.0.0.1:8188": None,  # the test server's address
    "width=832": "width=64",
    "height=480": "height=48",
    "size=832x480": "size=64x48",
    "num_frames=81": "num_frames=9",
    "num_inference_steps=30": "num_inference_steps=2",
}


def _doc_client_commands() -> str:
    blocks = VIDEOS_API_DOC.read_text().split("```bash\n")[1:]
    (commands,) = [block.split("```")[0] for block in blocks if "curl" in block]
    return commands


def test_the_docs_curl_commands_run_as_written(api_server, tmp_path):
    import shutil
    import subprocess

    if shutil.which("curl") is None or shutil.which("jq") is None:
        pytest.skip("SKIPPED: the docs' commands need curl and jq")
    commands = _doc_client_commands()
    for real, tiny in TINY_VALUES.items():
        assert real in commands, f"docs/videos-api.md's commands no longer hold {real!r}"
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


# The docs' SDK example's values for the real model, and the tiny model's.
SDK_TINY_VALUES = {
    "http://127.0.0.1:8188/v1": None,  # the test server's address
    'size="832x480"': f'size="{WIDTH}x{HEIGHT}"',
    'seconds="5"': 'seconds="0.5"',  # 8 frames at 16 fps: 9, the nearest 4n+1
    '"num_inference_steps": 30': '"num_inference_steps": 2',
}


def test_the_docs_openai_sdk_example_runs_as_written(api_server, tmp_path):
    import subprocess
    import sys

    (example,) = [block.split("```")[0] for block in VIDEOS_API_DOC.read_text().split("```python\n")[1:]]
    for real, tiny in SDK_TINY_VALUES.items():
        assert real in example, f"docs/videos-api.md's SDK example no longer holds {real!r}"
        example = example.replace(real, tiny or f"{api_server.url}/v1")
    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", example],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert _frames((tmp_path / "bird.mp4").read_bytes()).shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert PIL.Image.open(tmp_path / "bird.webp").size == (WIDTH, HEIGHT)
    listed = [line.split() for line in done.stdout.splitlines()]
    assert listed and all(status in ("queued", "in_progress", "completed", "failed") for _, status in listed)
    video_id = listed[0][0]  # newest first: the job the example made
    assert api_server.get(f"/v1/videos/{video_id}").json()["prompt"] == "A small blue bird takes off from a branch"


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


# --- the official OpenAI SDK as a client -------------------------------------------------------------------------
# openai-python, not our HTTP code: what it sends (multipart create, query parameters, extra_body fields) and what it
# parses (cursor pages, binary content, typed errors from the OpenAI error shape) are its own.

SMALL = {"size": f"{WIDTH}x{HEIGHT}", "extra_body": {"num_frames": FRAMES, "num_inference_steps": 1}}


def _sdk(server: ComfyServer):
    import openai

    # ComfyUI has no API keys; the SDK wants one. No retries: a refusal must come back as it is.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def sdk_jobs(api_server) -> list[str]:
    """Three finished jobs made through the SDK, in creation order."""
    client = _sdk(api_server)
    ids = [
        client.videos.create(
            prompt=f"a bird, take {seed}", **{**SMALL, "extra_body": {**SMALL["extra_body"], "seed": seed}}
        ).id
        for seed in (61, 62, 63)
    ]
    for video_id in ids:
        assert client.videos.poll(video_id, poll_interval_ms=100).status == "completed"
    return ids


def _history_of(server: ComfyServer, video_id: str) -> dict:
    (entry,) = [e for e in server.get("/history").json().values() if e["prompt"][3].get("wanvace_video") == video_id]
    return entry


def _cached_nodes(entry: dict) -> set[str]:
    return {node for kind, data in entry["status"]["messages"] if kind == "execution_cached" for node in data["nodes"]}


def test_sdk_list_pages_by_limit_order_and_after_and_auto_pagination_walks_every_job_once(api_server, sdk_jobs):
    import openai

    client = _sdk(api_server)
    first, second, third = sdk_jobs
    every = client.videos.list(limit=100)
    newest_first = [video.id for video in every.data]
    assert every.has_more is False and len(newest_first) == len(set(newest_first)) >= 3
    assert (every.first_id, every.last_id) == (newest_first[0], newest_first[-1])
    # Default order: newest first, by creation.
    assert [newest_first.index(video_id) for video_id in (third, second, first)] == sorted(
        newest_first.index(video_id) for video_id in sdk_jobs
    )
    created = [video.created_at for video in every.data]
    assert created == sorted(created, reverse=True)
    oldest_first = [video.id for video in client.videos.list(order="asc", limit=100).data]
    assert oldest_first == newest_first[::-1]
    assert [video.id for video in client.videos.list(order="desc", limit=100).data] == newest_first

    one = client.videos.list(limit=1)
    assert [video.id for video in one.data] == [newest_first[0]]
    assert (one.has_more, one.first_id, one.last_id) == (True, newest_first[0], newest_first[0])
    # The SDK's auto-pagination: one job a page, `after` the last id of each, until has_more is false.
    assert [video.id for video in client.videos.list(limit=1)] == newest_first
    assert [video.id for video in client.videos.list(limit=2, order="asc")] == oldest_first

    after_first = client.videos.list(order="asc", after=first, limit=2)
    assert [video.id for video in after_first.data] == [second, third]
    assert after_first.has_more is (oldest_first[-1] != third)
    assert client.videos.list(after=newest_first[-1]).data == []
    empty = client.videos.list(limit=0)
    assert (empty.data, empty.has_more, empty.first_id, empty.last_id) == ([], True, None, None)

    # OpenAI answers an unknown `after` with 404 (its own SDK's users catch NotFoundError there).
    with pytest.raises(openai.NotFoundError) as unknown:
        client.videos.list(after="video_" + "0" * 32)
    assert unknown.value.param == "after" and "is no video job" in unknown.value.message
    for query, param in (({"limit": 101}, "limit"), ({"limit": -1}, "limit"), ({"order": "newest"}, "order")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.videos.list(**query)
        assert refused.value.param == param, refused.value.message
    answer = api_server.get("/v1/videos?limit=ten")
    assert _error_of(answer)[:2] == (400, "limit")


def test_sdk_downloads_a_thumbnail_and_a_spritesheet_of_the_video_never_the_mp4(api_server, sdk_jobs):
    import openai

    client = _sdk(api_server)
    video_id = sdk_jobs[0]
    video = client.videos.download_content(video_id)
    frames = _frames(video.content)
    assert video.response.headers["content-type"] == "video/mp4" and frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert client.videos.download_content(video_id, variant="video").content == video.content

    thumbnail = client.videos.download_content(video_id, variant="thumbnail")
    assert thumbnail.response.headers["content-type"] == "image/webp"
    image = PIL.Image.open(io.BytesIO(thumbnail.content))
    assert (image.format, image.size) == ("WEBP", (WIDTH, HEIGHT))
    still = np.asarray(image.convert("RGB"), dtype=np.float32)
    # The first frame (WebP is lossy): far closer to it than to the video's last frame.
    to_first = np.abs(still - frames[0]).mean()
    assert to_first < 4 and to_first < np.abs(still - frames[-1]).mean(), to_first

    sheet = client.videos.download_content(video_id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    image = PIL.Image.open(io.BytesIO(sheet.content))
    # 9 frames: all of them, 3 by 3, at the video's size, row by row.
    assert (image.format, image.size) == ("JPEG", (3 * WIDTH, 3 * HEIGHT))
    tiles = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(3, HEIGHT, 3, WIDTH, 3).swapaxes(1, 2)
    for index in (0, 4, 8):
        assert np.abs(tiles.reshape(9, HEIGHT, WIDTH, 3)[index] - frames[index]).mean() < 6, index

    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.download_content(video_id, variant="poster")
    assert refused.value.param == "variant" and "thumbnail" in refused.value.message


def test_sdk_gets_typed_openai_errors_for_what_this_api_does_not_have(api_server, sdk_jobs):
    import openai

    client = _sdk(api_server)
    video_id = sdk_jobs[0]
    mp4 = ("clip.mp4", lossless_video(5, 3), "video/mp4")
    calls = {
        "remix": lambda: client.videos.remix(video_id, prompt="the same bird, at night"),
        "edits": lambda: client.videos.edit(prompt="at night", video=mp4),
        "extensions": lambda: client.videos.extend(prompt="it lands", seconds="4", video=mp4),
        "characters": lambda: client.videos.create_character(name="bird", video=mp4),
        "characters/": lambda: client.videos.get_character("char_1"),
    }
    for word, call in calls.items():
        with pytest.raises(openai.NotFoundError) as unserved:
            call()
        error = unserved.value
        assert error.type == "invalid_request_error" and error.code == "unknown_url", error.body
        assert f"it has no {word.rstrip('/')}" in error.message and "extra_params" in error.message, error.message
    # ComfyUI's /api mirror, and a method a served path does not take (405 with Allow, in the same shape).
    answer = api_server.http.post(f"{api_server.url}/api/v1/videos/{video_id}/remix", data={"prompt": "x"})
    assert _error_of(answer)[0] == 404 and "remix" in answer.json()["error"]["message"]
    answer = api_server.http.put(f"{api_server.url}/v1/videos/{video_id}", data={"prompt": "x"})
    assert _error_of(answer)[0] == 405 and answer.headers["Allow"] == "DELETE, GET"
    # Nothing outside /v1/videos changes: ComfyUI's own answers stay its own.
    assert api_server.http.post(f"{api_server.url}/v1/images/generations").headers["Content-Type"].startswith("text/")
    assert api_server.get("/system_stats").status_code == 200


def test_sdk_seed_through_extra_body_same_seed_same_video_another_seed_another(api_server):
    client = _sdk(api_server)

    def job(seed: int):
        video = client.videos.create_and_poll(
            prompt="a bird, seeded",
            poll_interval_ms=100,
            **{**SMALL, "extra_body": {**SMALL["extra_body"], "seed": seed}},
        )
        assert video.status == "completed", video.error
        return video.id, _history_of(api_server, video.id)

    first_id, first = job(71)
    _, again = job(71)
    other_id, other = job(72)
    sampler = node_id_of(first["prompt"][2], "WanVACESampler")
    assert first["prompt"][2][sampler]["inputs"]["seed"] == 71 and other["prompt"][2][sampler]["inputs"]["seed"] == 72
    # Same seed: ComfyUI served every node but the job's own SaveVideo from its cache, so the images are the same
    # tensors (its MP4 encode may still differ: see _assert_same_images).
    saver = node_id_of(again["prompt"][2], "SaveVideo")
    assert _cached_nodes(again) == set(again["prompt"][2]) - {saver}
    # Another seed: the sampler ran again, and the video differs beyond the encoder's noise (the same images saved
    # twice differed by at most 0.84 levels on average; these two by 3.8 in 0.33).
    assert sampler not in _cached_nodes(other)
    difference = np.abs(
        _frames(client.videos.download_content(other_id).content).astype(np.float32)
        - _frames(client.videos.download_content(first_id).content)
    ).mean()
    assert difference > 2, difference


@pytest.mark.every_variant
@pytest.mark.parametrize(
    ("create", "param", "fragment"),
    [
        ({"seconds": "-2"}, "seconds", "seconds=-2 must be positive"),
        ({"seconds": "-0.1"}, "seconds", "seconds=-0.1 must be positive"),
        ({"seconds": "0"}, "seconds", "seconds=0 must be positive"),
        ({"seconds": "0.01"}, "seconds", "shorter than one frame"),
        ({"seconds": "100"}, "seconds", "the most is 1025 frames"),
        ({"extra_body": {"num_frames": 100001}}, "num_frames", "num_frames=100001 is outside 1 to 1025"),
        ({"size": "65x48"}, "size", "its width 65 is not a positive multiple of 16; use 64"),
        ({"size": "64x8192"}, "size", "its height 8192 is outside 16 to 4096"),
        ({"size": "64 by 48"}, "size", "must be WIDTHxHEIGHT"),
        # Refused by ComfyUI's own checks of the node inputs, named by the request field that set them.
        ({"extra_body": {"num_inference_steps": 201}}, "num_inference_steps", "num_inference_steps: Value 201"),
        ({"extra_body": {"guidance_scale_2": 31}}, "guidance_scale_2", "guidance_scale_2: Value 31"),
        ({"extra_body": {"fps": 500}}, "fps", "fps: Value 500"),
        # The model the graph loads cannot run it (the tiny model's RoPE table: 32 patches of 16 px, 32 latent
        # frames): refused by the conditioning node when the job is queued, named by the field that set it.
        ({"size": "1024x48"}, "size", "size=1024x48: width=1024 is more than this model can run"),
        ({"extra_body": {"width": 64, "height": 528}}, "height", "height=528 is more than this model can run"),
        ({"seconds": "8"}, "seconds", "seconds=8 at fps=16 is num_frames=129: num_frames=129 gives 33 latent frames"),
        ({"extra_body": {"num_frames": 129}}, "num_frames", "use num_frames 125 or less, or connect extra_params."),
        # A refusal of the node's validate_inputs about two inputs (ComfyUI lists it under each of its arguments).
        (
            {"extra_body": {"extra_params": json.dumps({"vace_start_percent": 0.8, "vace_end_percent": 0.2})}},
            "extra_params.vace_start_percent",
            "vace_start_percent=0.8 is after vace_end_percent=0.2",
        ),
    ],
    ids=[
        "seconds-2",
        "seconds-0.1",
        "seconds0",
        "seconds0.01",
        "seconds100",
        "num_frames",
        "size65",
        "size8192",
        "sizeText",
        "steps",
        "cfg",
        "fps",
        "rope_size",
        "rope_height",
        "rope_seconds",
        "rope_num_frames",
        "vace_window",
    ],
)
def test_sdk_refusals_name_the_request_field_never_a_node_input(api_server, create, param, fragment):
    import openai

    client = _sdk(api_server)
    arguments = {**SMALL, **create, "extra_body": {**SMALL["extra_body"], **create.get("extra_body", {})}}
    if "seconds" in create:
        del arguments["extra_body"]["num_frames"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="a bird", **arguments)
    error = refused.value
    assert (error.param, error.type) == (param, "invalid_request_error"), error.message
    assert fragment in error.message, error.message
    for internal in ("WanVACE", "positive - ", "length=", "Custom validation"):
        assert internal not in error.message, error.message
    assert _temp_files(api_server) == []


# Last in the module: it restarts the module's server.
def test_sdk_after_a_restart_finished_jobs_stay_and_interrupted_ones_are_failed(api_server, sdk_jobs):
    import openai

    client = _sdk(api_server)
    kept = sdk_jobs[1]
    running, queued = _long_job(api_server, 81), _long_job(api_server, 82)
    deadline = time.monotonic() + 60
    while client.videos.retrieve(running).progress < 1:
        assert time.monotonic() < deadline, "the long job never made progress"
        time.sleep(0.05)
    assert client.videos.retrieve(queued).status == "queued"
    records = api_server.base_dir / "output" / "wanvace_api" / ".jobs"
    broken = records / f"video_{'f' * 32}.json"
    broken.write_text('{"record": {"id": ')  # a record cut short: the server must start anyway
    before = {video.id: video for video in client.videos.list(limit=100, order="asc")}

    api_server.stop()
    log_start = len(api_server.log_text())
    api_server.start(timeout=180)
    client = _sdk(api_server)

    skipped = [line for line in api_server.log_text()[log_start:].splitlines() if "job record" in line]
    assert len(skipped) == 1 and broken.name in skipped[0], skipped
    after = {video.id: video for video in client.videos.list(limit=100, order="asc")}
    assert list(after) == list(before)  # the same jobs, in the same order
    for video_id, stage in ((running, "running"), (queued, "queued")):
        video = client.videos.retrieve(video_id)
        assert (video.status, video.error.code) == ("failed", "server_stopped"), video
        assert f"the server stopped while this job was {stage}" in video.error.message
    finished = client.videos.retrieve(kept)
    assert finished.model_dump() == before[kept].model_dump()
    assert _frames(client.videos.download_content(kept).content).shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert client.videos.download_content(kept, variant="thumbnail").response.headers["content-type"] == "image/webp"

    videos = api_server.base_dir / "output" / "wanvace_api"
    assert [path.name for path in videos.glob(f"{kept}*")] and (records / f"{kept}.json").is_file()
    for video_id in (kept, running, queued):
        assert client.videos.delete(video_id).deleted is True
        assert list(videos.glob(f"{video_id}*")) == [] and not (records / f"{video_id}.json").exists()
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video_id)
    broken.unlink()
