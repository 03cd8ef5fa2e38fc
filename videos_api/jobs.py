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
import json
import logging
import os
import re
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


JOB_ID = re.compile(r"^video_[0-9a-f]{32}$")
STATUSES = ("queued", "in_progress", "completed", "failed")
# The job records' folder under output/wanvace_api/: hidden, so that ComfyUI's asset scanner (which skips dot-names)
# does not list the records among the outputs.
RECORDS = ".jobs"


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    seconds: str
    size: str
    folder: Path | None = None  # the job's temp folder: uploads and decoded data URIs (gone after a restart)
    created_ns: int = field(default_factory=time.time_ns)
    prompt_id: str | None = None
    save_node: str = ""
    sampler_node: str = ""
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict | None = None
    output: Path | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def of_request(cls, job_id: str, request: VideoRequest, model: str, folder: Path) -> VideoJob:
        return cls(
            id=job_id, model=model, prompt=request.prompt, seconds=request.seconds, size=request.size, folder=folder
        )

    @property
    def created_at(self) -> int:
        return self.created_ns // 1_000_000_000

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
            "prompt": self.prompt,
            "seconds": self.seconds,
            "size": self.size,
            "quality": "default",
            "media_type": "video/mp4",
            "remixed_from_video_id": None,
        }

    def state(self) -> dict:
        """What a restarted server needs: the record, and where ComfyUI put the job's prompt and video."""
        return {
            "record": self.record(),
            "created_ns": self.created_ns,
            "prompt_id": self.prompt_id,
            "output": None if self.output is None else self.output.name,
        }

    @classmethod
    def from_state(cls, job_id: str, state: dict, videos_dir: Path) -> VideoJob:
        """A job of an earlier run of the server; ValueError if the record is not one this module wrote."""
        record = state["record"]
        if record["id"] != job_id or record["status"] not in STATUSES:
            raise ValueError(f"id {record['id']!r} or status {record['status']!r} does not fit")
        output = state["output"]
        if output is not None and (Path(output).name != output or not output.startswith(job_id)):
            raise ValueError(f"output {output!r} is not the job's own file")
        job = cls(
            id=job_id,
            model=str(record["model"]),
            prompt=str(record["prompt"]),
            seconds=str(record["seconds"]),
            size=str(record["size"]),
            created_ns=int(state["created_ns"]),
            prompt_id=state["prompt_id"],
            status=record["status"],
            progress=int(record["progress"]),
            completed_at=record["completed_at"],
            error=record["error"],
            output=None if output is None else videos_dir / output,
        )
        if not job.finished:
            # Its prompt was in the queue of the server that stopped; this one never had it.
            stage = "queued" if job.status == "queued" else "running"
            job.status, job.completed_at = "failed", int(time.time())
            job.error = {
                "code": "server_stopped",
                "message": f"the server stopped while this job was {stage}; create it again.",
            }
        job.done.set()
        return job


class JobRecords:
    """One JSON file per job beside the videos, in `output/wanvace_api/.jobs/`: a record lives and goes with the
    video it describes (another `--output-directory`, a moved or cleared output folder), and the server reads them
    back when it starts. Each file is written whole and renamed into place, so a crash leaves the old record or the
    new one, never half of one."""

    def __init__(self, videos_dir: Path) -> None:
        self.videos_dir = videos_dir
        self.folder = videos_dir / RECORDS

    def save(self, job: VideoJob) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{job.id}.json"
        partial = self.folder / f".{job.id}.json.partial"
        with open(partial, "w", encoding="utf-8") as out:
            json.dump(job.state(), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{job_id}.json").unlink()

    def load(self) -> list[VideoJob]:
        """The jobs of earlier runs; an unreadable record is skipped with one log line (it never stops the server)."""
        if not self.folder.is_dir():
            return []
        for partial in self.folder.glob(".*.json.partial"):
            partial.unlink(missing_ok=True)  # a write the last run did not finish; its record is the one before
        jobs = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                if not JOB_ID.match(path.stem):
                    raise ValueError("the name is not a job id")
                state = json.loads(path.read_text(encoding="utf-8"))
                job = VideoJob.from_state(path.stem, state, self.videos_dir)
            except (OSError, ValueError, TypeError, KeyError) as error:
                logger.warning("WanVACE videos API: skipped the unreadable job record %s (%s)", path, error)
                continue
            if job.status != state["record"]["status"]:
                self.save(job)  # failed now: it was queued or running when the server stopped
            jobs.append(job)
        return jobs


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
    """The jobs of this server's videos API, with those of its earlier runs (read back from their records)."""

    def __init__(self, output_dir: str) -> None:
        self.client: ComfyClient | None = None  # set once the server listens (its address is known only then)
        self.output_dir = Path(output_dir).resolve()
        self.records = JobRecords(self.output_dir / OUTPUT_PREFIX)
        restored = self.records.load()
        self.jobs: dict[str, VideoJob] = {job.id: job for job in sorted(restored, key=lambda job: job.created_ns)}
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

    def page(self, limit: int, order: str, after: str | None) -> dict:
        """OpenAI's cursor page: up to `limit` jobs by creation (`asc` or `desc`), after the job `after`."""
        jobs = sorted(self.jobs.values(), key=lambda job: (job.created_ns, job.id), reverse=order == "desc")
        start = 0
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise ApiError(
                    404,
                    f"after={after!r} is no video job of this server (deleted, or never created); list again "
                    "without after.",
                    param="after",
                )
            start = ids.index(after) + 1
        data = jobs[start : start + limit]
        return {
            "object": "list",
            "data": [job.record() for job in data],
            "first_id": data[0].id if data else None,
            "last_id": data[-1].id if data else None,
            "has_more": start + limit < len(jobs),
        }

    def _keep(self, job: VideoJob) -> None:
        """Writes the job's record, unless it was deleted."""
        if job.id in self.jobs:
            self.records.save(job)

    async def submit(self, job: VideoJob, prompt: dict, request: VideoRequest) -> None:
        """Queues the job's prompt through `/prompt`; a rejection becomes a 400 naming the request field."""
        await self._ensure_listener()
        status, answer = await self.client.post(
            "/prompt", {"prompt": prompt, "client_id": self.client.client_id, "extra_data": {"wanvace_video": job.id}}
        )
        if status != 200 or not answer or "prompt_id" not in answer:
            self.discard(job)
            raise _rejection(prompt, answer, request)
        job.prompt_id = answer["prompt_id"]
        self.jobs[job.id] = job
        self._by_prompt[job.prompt_id] = job
        self._keep(job)

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
        self.records.remove(job.id)
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
        if job.folder is not None:
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
            self._keep(job)
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
        self._keep(job)
        job.done.set()
        self.discard(job)

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.completed_at = "failed", int(time.time())
        job.error = {"code": code, "message": message}
        self._keep(job)
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
    ("WanVACEConditioning", "positive"): "prompt",
    ("WanVACEConditioning", "negative"): "negative_prompt",
    ("WanVACEConditioning", "strength"): "extra_params.strength",
    ("WanVACEConditioning", "vace_start_percent"): "extra_params.vace_start_percent",
    ("WanVACEConditioning", "vace_end_percent"): "extra_params.vace_end_percent",
    ("WanVACELoraLoader", "lora_name"): "lora",
    ("CreateVideo", "fps"): "fps",
}
# Option nodes built from a JSON object of extra_params: their inputs are that object's keys.
OPTION_NODES = {"WanVACECacheOptions": "extra_params.cache", "WanVACEContextWindows": "extra_params.context_windows"}
# Node inputs that hold the video's size and length (the conditioning's, and the copies the shipped workflows give
# the nodes that arrange the inputs), by what they hold: the request field is the one that set it
# (`VideoRequest.sources`).
SIZE_OR_LENGTH_OF_INPUT = {
    (node, name): name
    for node in ("WanVACEConditioning", "WanVACEControlVideo", "WanVACEFirstLastFrame", "WanVACEOutpaintCanvas")
    for name in ("width", "height", "length")
}


def _node_refusals(prompt: dict, answer: dict) -> list[tuple[str, list[str], str]]:
    """(node class, inputs it was listed under, text) per distinct refusal. ComfyUI lists a node's `validate_inputs`
    refusal under every input that function takes, so one text may come under several inputs."""
    found: dict[tuple[str, str], list[str]] = {}
    for node_id, errors in (answer.get("node_errors") or {}).items():
        class_type = (prompt.get(node_id) or {}).get("class_type") or errors.get("class_type", "")
        for error in errors.get("errors", []):
            if not isinstance(error, dict):
                continue
            input_name = (error.get("extra_info") or {}).get("input_name") or ""
            details = str(error.get("details") or "")
            if error.get("type") == "custom_validation_failed":
                text = "" if details == input_name else details.removeprefix(f"{input_name} - ")
            else:
                text = str(error.get("message") or "invalid")
                if details and details != input_name:
                    text += f": {details}"
            found.setdefault((class_type, text.strip() or "invalid"), []).append(input_name)
    return [(class_type, inputs, text) for (class_type, text), inputs in found.items()]


def _about(inputs: list[str], text: str) -> str:
    """The input a refusal is about: the first it was listed under that the text names (`length=...`), else the
    first it was listed under."""
    for name in inputs:
        if name and re.search(rf"\b{re.escape(name)}\b", text):
            return name
    return inputs[0]


# Graph-editor names a node's refusal may give as the remedy, as the request spells them.
REQUEST_TERMS = {
    "WanVACE Context Windows": "extra_params.context_windows",
    "WanVACE Cache Options": "extra_params.cache",
}


def _in_request_terms(class_type: str, input_name: str, text: str, request: VideoRequest) -> tuple[str | None, str]:
    """The request field behind a refused node input, and the refusal worded in the request's terms."""
    for node_term, request_term in REQUEST_TERMS.items():
        text = text.replace(node_term, request_term)
    held = SIZE_OR_LENGTH_OF_INPUT.get((class_type, input_name))
    if (class_type, input_name) == ("WanVACEControlVideo", "length") and request.mode == "extension":
        # There it keeps extra_params.given_frames of the clip (prompts.build_prompt), not the video's length.
        param = "extra_params.given_frames"
        text = re.sub(r"\blength\b", "given_frames", text)
    elif held is not None:
        param = request.sources.get(held, "num_frames" if held == "length" else held)
        # The node's "length" is the request's frame count, whichever field set it.
        text = re.sub(r"\blength\b", "num_frames", text) if held == "length" else text
        if param == "size":
            return param, f"size={request.size}: {text}"
        if param == "seconds":
            seconds, fps = request.seconds_sent, request.fps
            return param, f"seconds={seconds:g} at fps={fps:g} is num_frames={request.num_frames}: {text}"
    else:
        param = PARAM_OF_INPUT.get((class_type, input_name), PARAM_OF_NODE.get(class_type))
        if class_type in OPTION_NODES and input_name:
            param = f"{OPTION_NODES[class_type]}.{input_name}"
        if param is not None and input_name and param.rpartition(".")[2] != input_name:
            text = re.sub(rf"\b{re.escape(input_name)}=", f"{param}=", text)
    if param is not None and not text.startswith(param):
        text = f"{param}: {text}"
    return param, text


def _rejection(prompt: dict, answer: dict | None, request: VideoRequest) -> ApiError:
    """ComfyUI's refusal of the prompt (its validation of every node input) as an error naming the request field
    that set the refused input, in the request's terms."""
    answer = answer or {}
    refusals = [
        _in_request_terms(class_type, _about(inputs, text), text, request)
        for class_type, inputs, text in _node_refusals(prompt, answer)
    ]
    if refusals:
        # The ones a field is known for first: the error has one param.
        refusals.sort(key=lambda refusal: refusal[0] is None)
        return ApiError(400, "; ".join(dict.fromkeys(text for _, text in refusals)), param=refusals[0][0])
    error = answer.get("error") or {}
    message = error.get("message") if isinstance(error, dict) else str(error)
    return ApiError(400, f"ComfyUI refused the job: {message or 'no reason given'}")


def job_folder(temp_dir: str, job_id: str) -> Path:
    folder = Path(temp_dir) / OUTPUT_PREFIX / job_id
    folder.mkdir(parents=True, exist_ok=False)
    os.chmod(folder, 0o700)
    return folder
