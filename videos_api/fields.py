"""The videos API's form fields (vLLM-Omni's multipart fields), validated into one `VideoRequest`.

Every refusal is an `ApiError` in the OpenAI error shape, naming the field. Nothing here touches the network:
`video_reference` / `image_reference` take only `data:` URIs, and an `http(s)` URL is refused, so the server never
fetches anything for a client.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from dataclasses import dataclass, field

from ..wanvace_core.generation.tasks import MODES

# Text fields and their parsers; `input_reference` is the one file field.
NUMBER_FIELDS = {
    "width": int,
    "height": int,
    "num_frames": int,
    "fps": float,
    "num_inference_steps": int,
    "guidance_scale": float,
    "guidance_scale_2": float,
    "boundary_ratio": float,
    "flow_shift": float,
    "seed": int,
    "seconds": float,
}
TEXT_FIELDS = (
    "prompt",
    "negative_prompt",
    "model",
    "size",
    "lora",
    "extra_params",
    "video_reference",
    "image_reference",
)
FILE_FIELDS = ("input_reference",)
KNOWN_FIELDS = frozenset((*NUMBER_FIELDS, *TEXT_FIELDS, *FILE_FIELDS))
EXTRA_PARAMS = frozenset(
    {
        "mode",
        "mask",
        "last_image",
        "reference_images",
        "outpaint",
        "given_frames",
        "strength",
        "vace_start_percent",
        "vace_end_percent",
        "scheduler",
        "cache",
        "context_windows",
    }
)
DEFAULTS = {
    "width": 832,
    "height": 480,
    "num_frames": 81,
    "fps": 16.0,
    "num_inference_steps": 30,
    "guidance_scale": 5.0,
    "seed": 42,
}
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_DATA_URI = re.compile(r"^data:([\w.+/-]+)?(;[\w=.+-]+)*;base64,(.*)$", re.DOTALL)


class ApiError(Exception):
    """A refusal as the OpenAI API shapes it: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_value", 404: "not_found", 413: "too_large"}.get(status, "error")

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Upload:
    """A file the request carried, streamed to the job's own temp folder: its path there and its kind."""

    field_name: str
    path: str
    kind: str  # "image" or "video"


@dataclass(frozen=True)
class VideoRequest:
    """One validated job. `mode` is the VACE task; uploads and decoded data URIs are files in the job's folder."""

    prompt: str
    negative_prompt: str
    model: str | None
    width: int
    height: int
    num_frames: int
    fps: float
    steps: int
    guidance_high: float
    guidance_low: float
    boundary_ratio: float | None
    flow_shift: float | None
    seed: int
    mode: str
    files: dict = field(default_factory=dict)  # input name (image, last_image, video, mask, reference) -> paths
    lora: tuple[str, float] | None = None
    extra: dict = field(default_factory=dict)
    # The request field that set each of the conditioning node's width, height and length ("size", "width",
    # "seconds", "num_frames", ...), and seconds as sent: a refusal of a node input names what the client sent.
    sources: dict = field(default_factory=dict)
    seconds_sent: float | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def seconds(self) -> str:
        return f"{self.num_frames / self.fps:g}"


def refuse_unknown(name: str) -> None:
    if name not in KNOWN_FIELDS:
        raise ApiError(400, f"unknown field {name!r}; the fields are {', '.join(sorted(KNOWN_FIELDS))}.", param=name)


def parse_number(name: str, text: str):
    try:
        value = NUMBER_FIELDS[name](text)
    except ValueError:
        kind = "a whole number" if NUMBER_FIELDS[name] is int else "a number"
        raise ApiError(400, f"{name}={text!r} is not {kind}.", param=name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ApiError(400, f"{name}={text!r} is not a finite number.", param=name)
    return value


def kind_of(name: str, content_type: str | None, head: bytes) -> str:
    """'image' or 'video' from the file's first bytes (the client's content type may be anything)."""
    if head.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM")) or head[8:12] == b"WEBP":
        return "image"
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free") or head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video"
    raise ApiError(
        400,
        f"{name} is not a readable image or video (content type {content_type or 'none'}); send a PNG, JPEG, WebP, "
        "MP4, MOV or WebM file.",
        param=name,
    )


def decode_data_uri(name: str, value: str, limit: int) -> bytes:
    """The bytes of a `data:...;base64,` URI; any other scheme (an http(s) URL above all) is refused unfetched."""
    if re.match(r"^\s*(https?|ftp|file)://", value, re.IGNORECASE):
        raise ApiError(
            400,
            f"{name} is a URL; this server never fetches URLs. Send the file as a data: URI "
            "(data:video/mp4;base64,...) or as the input_reference upload.",
            param=name,
        )
    match = _DATA_URI.match(value.strip())
    if match is None:
        raise ApiError(400, f"{name} must be a base64 data: URI (data:<type>;base64,<data>).", param=name)
    payload = match.group(3)
    if len(payload) * 3 // 4 > limit:
        raise ApiError(413, f"{name} is larger than the server's upload limit of {limit} bytes.", param=name)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name} is not valid base64.", param=name) from None


def parse_extra(text: str | None) -> dict:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"extra_params is not valid JSON ({error.msg}).", param="extra_params") from None
    if not isinstance(extra, dict):
        raise ApiError(400, "extra_params must be a JSON object.", param="extra_params")
    unknown = sorted(set(extra) - EXTRA_PARAMS)
    if unknown:
        raise ApiError(
            400,
            f"extra_params has unknown keys {unknown}; the keys are {', '.join(sorted(EXTRA_PARAMS))}.",
            param=f"extra_params.{unknown[0]}",
        )
    return extra


@functools.cache
def conditioning_ranges() -> dict[str, tuple[int, int]]:
    """The WanVACE Conditioning node's declared (min, max) of width, height and length: a request outside them is
    refused before it is queued, naming the request field (ComfyUI would refuse it naming the node's input)."""
    from ..nodes.conditioning import WanVACEConditioning

    inputs = WanVACEConditioning.define_schema().inputs
    return {item.id: (item.min, item.max) for item in inputs if item.id in ("width", "height", "length")}


def _size(values: dict) -> tuple[int, int, dict]:
    """Width, height and the field that set each (`size`, `width`/`height`, or the default's)."""
    width, height = values.get("width"), values.get("height")
    sources = {"width": "width", "height": "height"}
    if "size" in values:
        match = _SIZE.match(values["size"].strip())
        if match is None:
            raise ApiError(400, f"size={values['size']!r} must be WIDTHxHEIGHT, e.g. 832x480.", param="size")
        if width is None:
            width, sources["width"] = int(match.group(1)), "size"
        if height is None:
            height, sources["height"] = int(match.group(2)), "size"
    width = DEFAULTS["width"] if width is None else width
    height = DEFAULTS["height"] if height is None else height
    ranges = conditioning_ranges()
    for name, value in (("width", width), ("height", height)):
        low, high = ranges[name]
        problem = None
        if value <= 0 or value % 16:
            problem = f"is not a positive multiple of 16; use {max(16, round(value / 16) * 16)}"
        elif not low <= value <= high:
            problem = f"is outside {low} to {high}"
        if problem is None:
            continue
        if sources[name] == "size":
            raise ApiError(400, f"size={values['size']!r}: its {name} {value} {problem}.", param="size")
        raise ApiError(400, f"{name}={value} {problem}.", param=name)
    return width, height, sources


def _frames(values: dict, fps: float) -> tuple[int, str]:
    """The frame count and the field that set it (`num_frames`, else `seconds`, else the default's)."""
    frames, source = values.get("num_frames"), "num_frames"
    if frames is None and "seconds" in values:
        seconds, source = values["seconds"], "seconds"
        if seconds <= 0:
            raise ApiError(400, f"seconds={seconds:g} must be positive (the length of the video).", param="seconds")
        if seconds * fps < 1:
            raise ApiError(
                400,
                f"seconds={seconds:g} is shorter than one frame at fps={fps:g} ({1 / fps:.3g} s); ask for more.",
                param="seconds",
            )
        # That many seconds at fps, rounded to the nearest 4n+1 (Wan's VAE packs 4 frames after the first).
        frames = round(seconds * fps / 4) * 4 + 1
    frames = DEFAULTS["num_frames"] if frames is None else frames
    if frames < 1 or (frames - 1) % 4:
        nearest = max(1, round((frames - 1) / 4) * 4 + 1)
        raise ApiError(
            400, f"num_frames={frames} is not of the form 4n+1 (e.g. 33, 49, 81); use {nearest}.", param="num_frames"
        )
    low, high = conditioning_ranges()["length"]
    if not low <= frames <= high:
        if source == "seconds":
            raise ApiError(
                400,
                f"seconds={values['seconds']:g} at fps={fps:g} is {frames} frames; the most is {high} frames "
                f"({(high - 1) / fps:g} s at this fps).",
                param="seconds",
            )
        raise ApiError(400, f"num_frames={frames} is outside {low} to {high}.", param="num_frames")
    return frames, source


def _lora(text: str | None) -> tuple[str, float] | None:
    if not text:
        return None
    name, _, strength = text.rpartition(":")
    if not name:
        return text, 1.0
    try:
        return name, float(strength)
    except ValueError:
        return text, 1.0


def build_request(values: dict, uploads: list[Upload], files: dict) -> VideoRequest:
    """`values`: the parsed text and number fields; `uploads`: the file fields; `files`: the decoded data URIs and
    extra_params inputs already written to the job's folder (name -> path or list of paths)."""
    prompt = values.get("prompt", "")
    if not prompt.strip():
        raise ApiError(400, "prompt is required and must not be empty.", param="prompt")
    extra = parse_extra(values.get("extra_params"))
    width, height, sources = _size(values)
    fps = values.get("fps", DEFAULTS["fps"])
    if fps <= 0:
        raise ApiError(400, f"fps={fps} must be positive.", param="fps")
    frames, sources["length"] = _frames(values, fps)
    steps = values.get("num_inference_steps", DEFAULTS["num_inference_steps"])
    if steps < 1:
        raise ApiError(400, f"num_inference_steps={steps} must be at least 1.", param="num_inference_steps")
    low = values.get("guidance_scale", DEFAULTS["guidance_scale"])
    high = values.get("guidance_scale_2", low)
    for name, value in (("guidance_scale", low), ("guidance_scale_2", high)):
        if value < 1.0:
            raise ApiError(400, f"{name}={value} is below 1.0; use 1.0 to disable guidance.", param=name)
    boundary = values.get("boundary_ratio")
    if boundary is not None and not 0.0 <= boundary <= 1.0:
        raise ApiError(400, f"boundary_ratio={boundary} must lie in [0, 1].", param="boundary_ratio")
    shift = values.get("flow_shift")
    if shift is not None and shift <= 0:
        raise ApiError(400, f"flow_shift={shift} must be positive.", param="flow_shift")
    seed = values.get("seed", DEFAULTS["seed"])
    if not 0 <= seed < 2**64:
        raise ApiError(400, f"seed={seed} must lie in [0, 2**64).", param="seed")

    inputs = dict(files)
    for upload in uploads:
        inputs["image" if upload.kind == "image" else "video"] = upload.path
    mode = extra.get("mode")
    if mode is None:
        mode = "i2v" if "image" in inputs else "v2v" if "video" in inputs else "t2v"
    if mode not in MODES:
        raise ApiError(
            400, f"extra_params.mode={mode!r} is unknown; choose one of {', '.join(MODES)}.", "extra_params.mode"
        )
    return VideoRequest(
        prompt=prompt,
        negative_prompt=values.get("negative_prompt", ""),
        model=values.get("model") or None,
        width=width,
        height=height,
        num_frames=frames,
        fps=fps,
        steps=steps,
        guidance_high=high,
        guidance_low=low,
        boundary_ratio=boundary,
        flow_shift=shift,
        seed=seed,
        mode=mode,
        files=inputs,
        lora=_lora(values.get("lora")),
        extra=extra,
        sources=sources,
        seconds_sent=values.get("seconds"),
    )
