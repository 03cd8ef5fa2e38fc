"""Videos-API jobs: each one a prompt in ComfyUI's own queue, followed through ComfyUI's public HTTP and WebSocket
interface as any client follows its prompts (`/prompt`, `/queue`, `/interrupt`, `/history`, `/ws`).

So a job shares the loaded model, memory management and node cache with graph-editor prompts, shows in the queue
and history, and stops on Cancel like them. The pack adds no path into the executor: the routes can do nothing
that a client of `/prompt` could not. Records follow the OpenAI / vLLM-Omni video object (`queued`,
`in_progress`, `completed`, `failed`, with `progress` in percent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from .fields import ApiError, VideoRequest
from .prompts import OUTPUT_PREFIX

logger = logging.getLogger(__name__)

# Seconds between checks of ComfyUI's history while a caller waits, should a WebSocket event go missing.
HISTORY_POLL_S = 1.0
# Which node's rejection names which request field.
PARAM_OF_NODE = {
    "WanVACEModelLoader": "model",
    "WanVACEExpertsLoader": "model",
    "WanVACELoraLoader": "lora",
    "WanVACECacheOptions": "extra_params.cache",
    "WanVACEContextWindows": "extra_params.context_windows",
    "WanVACEConditioning": "extra_params",
    "WanVACESampler": "extra_params",
    "LoadImage": "input_reference",
    "LoadVideo": "input_reference",
    "LoadImageMask": "extra_params.mask",
}


@dataclass
class VideoJob:
    id: str
    request: VideoRequest
    model: str
    folder: Path  # the job's temp folder: uploads and decoded data URIs
    created_at: int = field(default_factory=lambda: int(time.time()))
    prompt_id: str | None = None
    save_node: str = ""
    sampler_node: str = ""
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict | None = None
    output: Path | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def record(self) -> dict:
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": None,
            "error": self.error,
            "prompt": self.request.prompt,
            "seconds": self.request.seconds,
            "size": self.request.size,
            "quality": "default",
            "media_type": "video/mp4",
            "remixed_from_video_id": None,
        }


class ComfyClient:
    """This ComfyUI server, reached the way any client reaches it."""

    def __init__(self, base_url: str, ssl: bool | None) -> None:
        self.base_url = base_url
        self.ssl = ssl
        self.client_id = f"wanvace-videos-api-{uuid.uuid4().hex}"
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def post(self, path: str, body: dict) -> tuple[int, dict | None]:
        async with self.session().post(f"{self.base_url}{path}", json=body, ssl=self.ssl) as response:
            data = await response.json(content_type=None) if response.content_length != 0 else None
            return response.status, data

    async def get(self, path: str) -> dict:
        async with self.session().get(f"{self.base_url}{path}", ssl=self.ssl) as response:
            return await response.json(content_type=None)

    def websocket(self):
        url = self.base_url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}"
        return self.session().ws_connect(url, ssl=self.ssl, heartbeat=30)


class VideoJobs:
    """The jobs of this server's videos API, in creation order."""

    def __init__(self, client: ComfyClient, output_dir: str) -> None:
        self.client = client
        self.output_dir = Path(output_dir).resolve()
        self.jobs: dict[str, VideoJob] = {}
        self._by_prompt: dict[str, VideoJob] = {}
        self._listener: asyncio.Task | None = None
        self._listening = asyncio.Event()

    @staticmethod
    def new_id() -> str:
        return f"video_{uuid.uuid4().hex}"

    def get(self, job_id: str) -> VideoJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no video job {job_id!r}; GET /v1/videos lists the jobs.", param="video_id")
        return job

    async def submit(self, job: VideoJob, prompt: dict) -> None:
        """Queues the job's prompt through `/prompt`; a rejection becomes a 400 naming the request field."""
        await self._ensure_listener()
        status, answer = await self.client.post(
            "/prompt", {"prompt": prompt, "client_id": self.client.client_id, "extra_data": {"wanvace_video": job.id}}
        )
        if status != 200 or not answer or "prompt_id" not in answer:
            self.discard(job)
            raise _rejection(prompt, answer)
        job.prompt_id = answer["prompt_id"]
        self.jobs[job.id] = job
        self._by_prompt[job.prompt_id] = job

    async def wait(self, job: VideoJob) -> None:
        while not job.finished:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(job.done.wait(), HISTORY_POLL_S)
            if not job.finished:
                await self.refresh(job)

    async def refresh(self, job: VideoJob) -> None:
        """Settles a job from ComfyUI's history (what the WebSocket events would have said)."""
        if job.finished or job.prompt_id is None:
            return
        history = (await self.client.get(f"/history/{job.prompt_id}")).get(job.prompt_id)
        if history is None:
            return
        status = history.get("status", {})
        if status.get("status_str") == "success" or status.get("completed"):
            self._complete(job, history.get("outputs", {}))
        elif status.get("status_str") == "error":
            message = next(
                (
                    data.get("exception_message")
                    for kind, data in status.get("messages", [])
                    if kind == "execution_error"
                ),
                None,
            )
            interrupted = any(kind == "execution_interrupted" for kind, _ in status.get("messages", []))
            self._fail(job, "cancelled" if interrupted else "generation_failed", message or "the prompt failed")

    async def delete(self, job: VideoJob) -> None:
        """Removes a queued job from the queue, or stops a running one within a step; then its files."""
        self.jobs.pop(job.id, None)
        if not job.finished and job.prompt_id is not None:
            await self.client.post("/queue", {"delete": [job.prompt_id]})
            queue = await self.client.get("/queue")
            running = {item[1] for item in queue.get("queue_running", [])}
            if job.prompt_id in running:
                await self.client.post("/interrupt", {"prompt_id": job.prompt_id})
            else:
                self._fail(job, "deleted", "the job was deleted before it ran")
        if job.finished:
            self.discard(job)

    def discard(self, job: VideoJob) -> None:
        """Deletes the job's temp folder and, for a deleted job, its video."""
        shutil.rmtree(job.folder, ignore_errors=True)
        if job.id not in self.jobs and job.output is not None:
            with contextlib.suppress(FileNotFoundError):
                job.output.unlink()
        if job.prompt_id is not None and job.finished:
            self._by_prompt.pop(job.prompt_id, None)

    # --- events ---------------------------------------------------------------------------------------------

    async def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listening.clear()
            self._listener = asyncio.get_running_loop().create_task(self._listen())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._listening.wait(), 10)

    async def _listen(self) -> None:
        while True:
            try:
                async with self.client.websocket() as socket:
                    self._listening.set()
                    async for message in socket:
                        if message.type == aiohttp.WSMsgType.TEXT:
                            self._on_event(message.json())
            except (aiohttp.ClientError, OSError, ValueError) as error:
                logger.warning("WanVACE videos API: ComfyUI's event socket closed (%s); reconnecting", error)
            await asyncio.sleep(1.0)

    def _on_event(self, event: dict) -> None:
        data = event.get("data") or {}
        job = self._by_prompt.get(data.get("prompt_id"))
        if job is None or job.finished:
            return
        kind = event.get("type")
        if kind in ("execution_start", "executing") and job.status == "queued":
            job.status = "in_progress"
        elif kind == "progress" and str(data.get("node")) == job.sampler_node and data.get("max"):
            job.status = "in_progress"
            job.progress = min(99, int(100 * data["value"] / data["max"]))
        elif kind == "execution_error":
            self._fail(job, "generation_failed", data.get("exception_message") or "the prompt failed")
        elif kind == "execution_interrupted":
            self._fail(job, "cancelled", "the job was cancelled (Cancel in ComfyUI, or DELETE)")
        elif kind == "execution_success":
            asyncio.get_running_loop().create_task(self.refresh(job))

    def _complete(self, job: VideoJob, outputs: dict) -> None:
        found = [
            entry
            for values in (outputs.get(job.save_node) or {}).values()
            if isinstance(values, list)
            for entry in values
            if isinstance(entry, dict) and "filename" in entry
        ]
        path = None
        if found:
            path = (self.output_dir / found[0].get("subfolder", "") / found[0]["filename"]).resolve()
            # Only the job's own file, under its own prefix, is ever served.
            if path.parent != self.output_dir / OUTPUT_PREFIX or not path.name.startswith(job.id):
                path = None
        if path is None or not path.is_file():
            self._fail(job, "generation_failed", "the prompt ran but saved no video")
            return
        job.output, job.status, job.progress, job.completed_at = path, "completed", 100, int(time.time())
        job.done.set()
        self.discard(job)

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.completed_at = "failed", int(time.time())
        job.error = {"code": code, "message": message}
        job.done.set()
        self.discard(job)


# A rejected node input, by node and input name, as the request field that set it.
PARAM_OF_INPUT = {
    ("WanVACESampler", "steps"): "num_inference_steps",
    ("WanVACESampler", "seed"): "seed",
    ("WanVACESampler", "cfg"): "guidance_scale_2",
    ("WanVACESampler", "cfg_low_noise"): "guidance_scale",
    ("WanVACESampler", "boundary_ratio"): "boundary_ratio",
    ("WanVACESampler", "shift"): "flow_shift",
    ("WanVACESampler", "scheduler"): "extra_params.scheduler",
    ("WanVACEConditioning", "width"): "width",
    ("WanVACEConditioning", "height"): "height",
    ("WanVACEConditioning", "length"): "num_frames",
    ("WanVACEConditioning", "positive"): "prompt",
    ("WanVACEConditioning", "negative"): "negative_prompt",
    ("WanVACEConditioning", "strength"): "extra_params.strength",
    ("CreateVideo", "fps"): "fps",
}


def _rejection(prompt: dict, answer: dict | None) -> ApiError:
    """ComfyUI's refusal of the prompt (its validation of every node input) as an error naming the request field."""
    answer = answer or {}
    for node_id, errors in (answer.get("node_errors") or {}).items():
        class_type = (prompt.get(node_id) or {}).get("class_type") or errors.get("class_type", "")
        for error in errors.get("errors", []):
            if not isinstance(error, dict):
                continue
            input_name = (error.get("extra_info") or {}).get("input_name")
            param = PARAM_OF_INPUT.get((class_type, input_name), PARAM_OF_NODE.get(class_type))
            message = error.get("message", "invalid")
            details = error.get("details")
            return ApiError(400, f"{message}: {details} ({class_type} {input_name or ''})".strip(), param=param)
    error = answer.get("error") or {}
    message = error.get("message") if isinstance(error, dict) else str(error)
    return ApiError(400, f"ComfyUI refused the job: {message or 'no reason given'}")


def job_folder(temp_dir: str, job_id: str) -> Path:
    folder = Path(temp_dir) / OUTPUT_PREFIX / job_id
    folder.mkdir(parents=True, exist_ok=False)
    os.chmod(folder, 0o700)
    return folder
