"""Still images of a finished job's MP4 for `GET /v1/videos/{id}/content?variant=...`: OpenAI's `thumbnail` (a WebP
of the first frame, at the video's size) and `spritesheet` (a JPEG grid of frames spread over the video). Decoded
with PyAV, which ComfyUI's own video nodes use; encoded with Pillow."""

from __future__ import annotations

import io
import math
from pathlib import Path

import av
import numpy as np
import PIL.Image

# OpenAI's content types for the variants (its guide saves them as .webp and .jpg).
CONTENT_TYPES = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/jpeg"}
SHEET_FRAMES = 16  # at most, spread evenly from the first frame to the last
SHEET_TILE_WIDTH = 256  # tiles of wider videos are scaled down to this width


def _spread(total: int, count: int) -> list[int]:
    """`count` frame indices spread evenly from the first frame to the last of `total`."""
    count = min(count, total)
    return sorted({round(index * (total - 1) / max(1, count - 1)) for index in range(count)})


def _frames(path: Path, count: int) -> list[np.ndarray]:
    """Up to `count` frames spread over the video (the first one for 1), as RGB arrays; only those are kept."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        wanted = set(_spread(stream.frames, count)) if stream.frames else None
        frames = []
        for index, frame in enumerate(container.decode(stream)):
            if wanted is None or index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if count == 1 or (wanted is not None and len(frames) == len(wanted)):
                break
    if not frames:
        raise ValueError(f"{path.name} holds no video frames")
    if wanted is None:  # the container did not say how many frames it holds
        frames = [frames[index] for index in _spread(len(frames), count)]
    return frames


def thumbnail(path: Path) -> bytes:
    """The first frame as a WebP image at the video's size."""
    (first,) = _frames(path, 1)
    out = io.BytesIO()
    PIL.Image.fromarray(first).save(out, format="WEBP", quality=90)
    return out.getvalue()


def spritesheet(path: Path) -> bytes:
    """Up to `SHEET_FRAMES` frames, evenly spaced, as a JPEG grid (row by row, `ceil(sqrt(n))` columns)."""
    picked = _frames(path, SHEET_FRAMES)
    count = len(picked)
    height, width = picked[0].shape[:2]
    if width > SHEET_TILE_WIDTH:
        width, height = SHEET_TILE_WIDTH, max(1, round(height * SHEET_TILE_WIDTH / width))
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    sheet = PIL.Image.new("RGB", (columns * width, rows * height))
    for index, frame in enumerate(picked):
        tile = PIL.Image.fromarray(frame)
        if tile.size != (width, height):
            tile = tile.resize((width, height), PIL.Image.Resampling.BILINEAR)
        sheet.paste(tile, ((index % columns) * width, (index // columns) * height))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=90)
    return out.getvalue()
