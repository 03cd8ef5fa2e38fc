"""The videos API's routes on ComfyUI's own server: `POST /v1/videos/sync`, `POST /v1/videos`, `GET /v1/videos`,
`GET /v1/videos/{id}`, `GET /v1/videos/{id}/content`, `DELETE /v1/videos/{id}` (ComfyUI also serves each under
`/api`). Any other method or path under `/v1/videos` (OpenAI's remix, edits, extensions, characters) is answered
404 or 405 in the OpenAI error shape, so OpenAI's clients raise their typed error with our message.

Uploads are streamed to the job's own folder under ComfyUI's temp directory, never past ComfyUI's
`--max-upload-size` (the limit of its own uploads), and removed when the job ends or is deleted. The model is
`model`, else the `WANVACE_API_MODEL` environment variable, else `default_model` in ComfyUI's
`user/wanvace_videos_api.json`; it names a folder the WanVACE Model Loader lists, or a single-file set that file
defines (`single_file_models`: name -> the WanVACE Experts Loader's files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import av
import folder_paths
from aiohttp import web

from .fields import (
    FILE_FIELDS,
    NUMBER_FIELDS,
    ApiError,
    Upload,
    build_request,
    decode_data_uri,
    kind_of,
    parse_extra,
    parse_number,
    refuse_unknown,
)
from .jobs import ComfyClient, VideoJob, VideoJobs, job_folder
from .media import CONTENT_TYPES, spritesheet, thumbnail
from .prompts import build_prompt

logger = logging.getLogger(__name__)

MODEL_ENV = "WANVACE_API_MODEL"
CHUNK = 1 << 16
_DATA_URI_FIELDS = {"video_reference": "video", "image_reference": "image"}
_EXTRA_FILES = ("mask", "last_image")
_SUFFIX = {"image": ".png", "video": ".mp4"}


def _upload_limit() -> int:
    from comfy.cli_args import args

    return int(args.max_upload_size * 1024 * 1024)


def _error(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


SETTINGS_FILE = "wanvace_videos_api.json"
# A single-file model set: the WanVACE Experts Loader's file inputs (the four first are required).
SET_FILES = ("high_noise_model", "low_noise_model", "text_encoder", "vae")
SET_OPTIONS = ("dtype", "weight_dtype", "boundary_ratio", "high_noise_vace_module", "low_noise_vace_module")


def _settings() -> tuple[Path, dict]:
    """ComfyUI's user folder's `wanvace_videos_api.json`: `default_model` and named `single_file_models`."""
    path = Path(folder_paths.get_user_directory()) / SETTINGS_FILE
    if not path.is_file():
        return path, {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ApiError(500, f"the videos API's settings file {path} is not readable JSON ({error}).") from None
    sets = settings.get("single_file_models", {}) if isinstance(settings, dict) else None
    if not isinstance(sets, dict) or set(settings) - {"default_model", "single_file_models"}:
        raise ApiError(
            500, f"{path} must be a JSON object with default_model (a name) and single_file_models (name -> files)."
        )
    for name, files in sets.items():
        if not isinstance(files, dict) or set(SET_FILES) - set(files) or set(files) - {*SET_FILES, *SET_OPTIONS}:
            raise ApiError(
                500,
                f"{path}: single_file_models[{name!r}] must name {', '.join(SET_FILES)} (and may set "
                f"{', '.join(SET_OPTIONS)}), as the WanVACE Experts Loader takes them.",
            )
    return path, settings


def _model(requested: str | None) -> tuple[str, dict | None]:
    """The model's name and, for a single-file set, its Experts Loader inputs (None for a pipeline folder)."""
    from ..nodes.folder_loader import list_model_folders

    path, settings = _settings()
    sets = settings.get("single_file_models", {})
    listed = [*list_model_folders(), *sorted(sets)]
    model = requested or os.environ.get(MODEL_ENV) or settings.get("default_model") or None
    if model is None:
        raise ApiError(
            400,
            f"model is required: no default is set ({MODEL_ENV}, or default_model in {path}); the models are: "
            + (", ".join(listed) or "none (put a pipeline folder into ComfyUI's models/diffusers)"),
            param="model",
        )
    if model not in listed:
        raise ApiError(
            404,
            f"model {model!r} is not listed; the models are: {', '.join(listed) or 'none'}.",
            param="model",
            code="model_not_found",
        )
    return model, sets.get(model)


class _Budget:
    """What is left of the upload limit for the whole request (ComfyUI's limit is per request, too)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.left = limit, limit

    def take(self, size: int, name: str) -> None:
        self.left -= size
        if self.left < 0:
            raise ApiError(
                413, f"{name} takes the request over the server's upload limit of {self.limit} bytes.", param=name
            )


async def _write_part(part, path: Path, name: str, budget: _Budget) -> bytes:
    """Streams one multipart file part to `path`; returns its first bytes."""
    written, head = 0, b""
    with open(path, "wb") as out:
        while chunk := await part.read_chunk(CHUNK):
            budget.take(len(chunk), name)
            written += len(chunk)
            if len(head) < 16:
                head += chunk[: 16 - len(head)]
            out.write(chunk)
    if written == 0:
        raise ApiError(400, f"{name} is empty.", param=name)
    return head


async def _read_text(part, name: str, budget: _Budget) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK):
        budget.take(len(chunk), name)
        data += chunk
    try:
        return data.decode(part.get_charset(default="utf-8"))
    except (UnicodeDecodeError, LookupError):
        raise ApiError(400, f"{name} is not UTF-8 text.", param=name) from None


def _write_decoded(folder: Path, name: str, data: bytes, expected: str | None) -> str:
    kind = kind_of(name, None, data[:16])
    if expected is not None and kind != expected:
        raise ApiError(
            400,
            f"{name} is a file of kind {kind}; it must be an {expected}."
            if expected == "image"
            else f"{name} is a file of kind {kind}; it must be a {expected}.",
            param=name,
        )
    path = folder / f"{name.replace('.', '_')}{_SUFFIX[kind]}"
    path.write_bytes(data)
    return str(path)


async def _parse(request: web.Request, folder: Path) -> dict:
    """Reads the multipart form into the job's folder; returns the `build_request` arguments."""
    if not request.content_type.startswith("multipart/form-data"):
        raise ApiError(400, "send the fields as multipart/form-data (curl -F name=value).", param=None)
    limit = _upload_limit()
    budget = _Budget(limit)
    values, uploads, files, data_uris = {}, [], {}, {}
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        name = part.name or ""
        refuse_unknown(name)
        if name in FILE_FIELDS:
            if not part.filename:
                raise ApiError(400, f"{name} must be a file upload (curl -F {name}=@file).", param=name)
            path = folder / f"{name}.upload"
            head = await _write_part(part, path, name, budget)
            kind = kind_of(name, part.headers.get("Content-Type"), head)
            final = path.with_suffix(_SUFFIX[kind])
            path.rename(final)
            uploads.append(Upload(name, str(final), kind))
            continue
        text = await _read_text(part, name, budget)
        if name in NUMBER_FIELDS:
            values[name] = parse_number(name, text.strip())
        elif name in _DATA_URI_FIELDS:
            values[name] = True
            data_uris[name] = text
        else:
            values[name] = text
    for name, text in data_uris.items():
        if uploads:
            raise ApiError(
                400,
                f"{name} and input_reference cannot both be given; send one reference (an image for image-to-video, "
                "a video for video-to-video).",
                param=name,
            )
        kind = _DATA_URI_FIELDS[name]
        files[kind] = _write_decoded(folder, name, decode_data_uri(name, text, limit), kind)
    extra = parse_extra(values.get("extra_params"))
    for name in _EXTRA_FILES:
        if name in extra:
            param = f"extra_params.{name}"
            files[name] = _write_decoded(folder, param, decode_data_uri(param, str(extra[name]), limit), "image")
    if "reference_images" in extra:
        references = extra["reference_images"]
        if not isinstance(references, list) or not references:
            raise ApiError(
                400, "extra_params.reference_images must be a list of data: URIs.", "extra_params.reference_images"
            )
        files["reference"] = [
            _write_decoded(
                folder,
                f"extra_params.reference_images.{index}",
                decode_data_uri("extra_params.reference_images", str(uri), limit),
                "image",
            )
            for index, uri in enumerate(references)
        ]
    return {"values": values, "uploads": uploads, "files": files}


class VideosApi:
    """The routes, bound to one server's jobs."""

    def __init__(self, jobs: VideoJobs, temp_dir: str) -> None:
        self.jobs = jobs
        self.temp_dir = temp_dir

    async def _create(self, request: web.Request) -> VideoJob:
        job_id = self.jobs.new_id()
        folder = job_folder(self.temp_dir, job_id)
        try:
            parsed = await _parse(request, folder)
            video = build_request(**parsed)
            model, single_files = _model(video.model)
            job = VideoJob.of_request(job_id, video, model, folder)
            prompt, job.save_node, job.sampler_node = build_prompt(video, job_id, model, self.temp_dir, single_files)
            await self.jobs.submit(job, prompt, video)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return job

    async def create(self, request: web.Request) -> web.Response:
        try:
            job = await self._create(request)
        except ApiError as error:
            return _error(error)
        return web.json_response(job.record())

    async def create_sync(self, request: web.Request) -> web.StreamResponse:
        try:
            job = await self._create(request)
        except ApiError as error:
            return _error(error)
        try:
            await self.jobs.wait(job)
        except BaseException:
            # The client went away: its job is not left running for nobody.
            with contextlib.suppress(Exception):
                await self.jobs.delete(job)
            raise
        if job.status != "completed":
            return web.json_response(
                {
                    "error": {
                        "message": job.error["message"],
                        "type": "server_error",
                        "param": None,
                        "code": job.error["code"],
                    }
                },
                status=500,
            )
        return web.FileResponse(job.output, headers={"Content-Type": "video/mp4", "X-Video-Id": job.id})

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            job = self.jobs.get(request.match_info["video_id"])
        except ApiError as error:
            return _error(error)
        await self.jobs.refresh(job)
        return web.json_response(job.record())

    async def list(self, request: web.Request) -> web.Response:
        """OpenAI's cursor list: `limit` (0 to 100, default 20), `order` (`asc`/`desc` by creation, default `desc`,
        newest first), `after` (the last id of the page before); `has_more`, `first_id`, `last_id`."""
        try:
            limit = _query_int(request, "limit", default=LIST_LIMIT, low=0, high=LIST_LIMIT_MAX)
            order = request.query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise ApiError(400, f"order={order!r} must be asc or desc.", param="order")
            page = self.jobs.page(limit, order, request.query.get("after") or None)
        except ApiError as error:
            return _error(error)
        return web.json_response(page)

    async def content(self, request: web.Request) -> web.StreamResponse:
        try:
            variant = request.query.get("variant", "video")
            if variant not in CONTENT_TYPES:
                raise ApiError(400, f"variant={variant!r} is not one of {', '.join(CONTENT_TYPES)}.", param="variant")
            job = self.jobs.get(request.match_info["video_id"])
            await self.jobs.refresh(job)
            if job.status != "completed":
                raise ApiError(
                    404 if job.status == "failed" else 409,
                    f"video {job.id} is {job.status}; its content is there once it is completed.",
                    param="video_id",
                    code="video_not_ready",
                )
            if job.output is None or not job.output.is_file():
                raise ApiError(
                    404,
                    f"the video file of {job.id} is no longer in {self.jobs.records.videos_dir}; delete the job.",
                    param="video_id",
                    code="video_file_missing",
                )
        except ApiError as error:
            return _error(error)
        if variant == "video":
            return web.FileResponse(job.output, headers={"Content-Type": CONTENT_TYPES["video"]})
        still = thumbnail if variant == "thumbnail" else spritesheet
        try:
            body = await asyncio.to_thread(still, job.output)
        except (av.error.FFmpegError, ValueError) as error:
            return _error(ApiError(500, f"the video file of {job.id} could not be read ({error}).", code="bad_video"))
        return web.Response(body=body, content_type=CONTENT_TYPES[variant])

    async def delete(self, request: web.Request) -> web.Response:
        try:
            job = self.jobs.get(request.match_info["video_id"])
        except ApiError as error:
            return _error(error)
        await self.jobs.delete(job)
        return web.json_response({"id": job.id, "object": "video.deleted", "deleted": True})


LIST_LIMIT, LIST_LIMIT_MAX = 20, 100  # OpenAI's default and largest page


def _query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ApiError(400, f"{name}={text!r} is not a whole number.", param=name) from None
    if not low <= value <= high:
        raise ApiError(400, f"{name}={value} is outside {low} to {high}.", param=name)
    return value


# The routes, as (method, path, VideosApi method); the middleware below answers every other one under /v1/videos.
ROUTES = (
    ("POST", "/v1/videos/sync", "create_sync"),
    ("POST", "/v1/videos", "create"),
    ("GET", "/v1/videos", "list"),
    ("GET", "/v1/videos/{video_id}", "retrieve"),
    ("GET", "/v1/videos/{video_id}/content", "content"),
    ("DELETE", "/v1/videos/{video_id}", "delete"),
)
_ROUTE_PATTERNS = [(method, re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", path) + "$")) for method, path, _ in ROUTES]
# What to send instead of OpenAI's requests that this API does not have, by the path's last word.
_INSTEAD = {
    "remix": 'create a new video with extra_params {"mode": "v2v"} and the video as video_reference',
    "edits": 'create a new video with extra_params {"mode": "v2v"} (or "inpaint" with a mask) and the video as '
    "video_reference",
    "extensions": 'create a new video with extra_params {"mode": "extension"} and the video as video_reference',
    "characters": 'give reference images: extra_params {"mode": "r2v", "reference_images": [...]}',
}


def _unserved(request: web.Request, path: str) -> web.Response:
    """OpenAI's answer to a path it does not have (404) or a method a path does not take (405), in its error
    shape."""
    word = next((word for word in reversed(path.split("/")) if word in _INSTEAD), None)
    allowed = sorted({method for method, pattern in _ROUTE_PATTERNS if pattern.match(path)})
    if allowed and word is None:
        error = ApiError(
            405,
            f"{request.method} {path} is not served; this path takes {', '.join(allowed)}.",
            code="method_not_allowed",
        )
        return web.json_response(error.body(), status=405, headers={"Allow": ", ".join(allowed)})
    message = (
        f"Invalid URL ({request.method} {path}): this server's videos API creates, lists, retrieves, downloads and "
        "deletes videos; " + (f"it has no {word}: {_INSTEAD[word]}." if word else "it has no such request.")
    )
    return _error(ApiError(404, message, code="unknown_url"))


@web.middleware
async def unserved_as_openai_errors(request: web.Request, handler):
    """Under `/v1/videos` (and ComfyUI's `/api` mirror of it) only: ComfyUI's plain-text 404/405 for a route the
    videos API does not serve (its static files take every GET path, so other methods get 405) become OpenAI's
    error shape. Routes are resolved before any middleware runs, so a route another pack serves there still
    answers itself."""
    path = request.path.removeprefix("/api")
    if path != "/v1/videos" and not path.startswith("/v1/videos/"):
        return await handler(request)
    # ComfyUI's static files match every GET path; their 404 comes only when the response is sent.
    if isinstance(getattr(request.match_info.route, "resource", None), web.StaticResource):
        return _unserved(request, path)
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
        return _unserved(request, path)


def _base_url(server) -> tuple[str, bool | None]:
    from comfy.cli_args import args

    address = getattr(server, "address", None) or "127.0.0.1"
    if address in ("0.0.0.0", ""):
        address = "127.0.0.1"
    elif address == "::":
        address = "::1"
    host = f"[{address}]" if ":" in address else address
    tls = bool(getattr(args, "tls_keyfile", None) and getattr(args, "tls_certfile", None))
    # Our own server: its certificate may be self-signed, and the address is its own.
    return f"{'https' if tls else 'http'}://{host}:{server.port}", (False if tls else None)


_installed = False


def install_videos_api() -> None:
    """Adds the routes to ComfyUI's server (once; ComfyUI registers them when it starts listening) and reads back the
    jobs of its earlier runs."""
    global _installed
    if _installed:
        return
    from server import PromptServer

    server = PromptServer.instance
    api = _LazyApi(server, VideoJobs(folder_paths.get_output_directory()))
    for method, path, name in ROUTES:
        server.routes.route(method, path)(api.call(name))
    server.app.middlewares.append(unserved_as_openai_errors)
    _installed = True


class _LazyApi:
    """Builds the `VideosApi` at the first request: the server's address and port are known only once it listens."""

    def __init__(self, server, jobs: VideoJobs) -> None:
        self.server = server
        self.jobs = jobs
        self.api: VideosApi | None = None

    def call(self, method: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            if self.api is None:
                self.jobs.client = ComfyClient(*_base_url(self.server))
                self.api = VideosApi(self.jobs, folder_paths.get_temp_directory())
            return await getattr(self.api, method)(request)

        handler.__name__ = f"wanvace_videos_{method}"
        return handler
