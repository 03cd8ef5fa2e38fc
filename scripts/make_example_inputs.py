"""Write the example inputs the shipped workflows name into `example_inputs/`.

The pack copies these files into ComfyUI's input folder when it loads (`nodes/examples.py`), so
every shipped workflow opens with its LoadImage / LoadVideo / LoadImageMask inputs in place. They are
drawn here from code (no downloaded media), small (a few KB each; the videos 81 frames, as long as the
workflows' videos, under 40 KB) and in the workflows' aspect ratio (832x480, i.e. 208x120 pixels; the workflows
scale them to their own size).

    .venvs/current/bin/python scripts/make_example_inputs.py           # (re)write the files
    .venvs/current/bin/python scripts/make_example_inputs.py --check   # exit 1 if a file differs

Running it twice gives the same PNG pixels and the same decoded video frames. The MP4 bytes depend on
the libx264 build inside PyAV, so `--check` compares decoded frames (within video-codec tolerance),
frame count, size and rate, not bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "example_inputs"

# 832x480 (the workflows' size) divided by 4.
WIDTH, HEIGHT = 208, 120
# As many frames as the workflows' videos (81 = 5 s at 16 fps), so a control or source clip covers all of them.
FRAMES, FPS = 81, 16
# Largest mean absolute difference (0-255) a re-encoded frame may show in --check.
VIDEO_TOLERANCE = 3.0


# --- drawing -----------------------------------------------------------------


def _sky(top: tuple[int, int, int], bottom: tuple[int, int, int]) -> Image.Image:
    t = np.linspace(0.0, 1.0, HEIGHT, dtype=np.float32)[:, None, None]
    rows = (1 - t) * np.array(top, np.float32) + t * np.array(bottom, np.float32)
    return Image.fromarray(np.repeat(rows, WIDTH, axis=1).round().astype(np.uint8))


def _hills(draw: ImageDraw.ImageDraw, far: tuple, near: tuple, shift: int = 0) -> None:
    def ridge(base: int, amp: float, period: float, phase: float) -> list[tuple[int, int]]:
        points = [(x, round(base + amp * math.sin((x + shift) / period + phase))) for x in range(-4, WIDTH + 5, 4)]
        return [(-4, HEIGHT), *points, (WIDTH + 4, HEIGHT)]

    draw.polygon(ridge(78, 7, 23, 0.5), fill=far)
    draw.polygon(ridge(92, 5, 17, 2.0), fill=near)


def _tree(draw: ImageDraw.ImageDraw, x: int, crown: tuple) -> None:
    draw.rectangle([x - 2, 70, x + 2, 96], fill=(92, 60, 36))
    draw.ellipse([x - 14, 44, x + 14, 76], fill=crown)


def _landscape(sunset: bool, shift: int = 0, sun_x: int = 150) -> Image.Image:
    if sunset:
        img = _sky((70, 60, 140), (250, 150, 80))
        sun, sun_y = (250, 90, 50), 70
        far, near, crown = (60, 80, 60), (40, 60, 40), (40, 80, 40)
    else:
        img = _sky((70, 130, 220), (190, 225, 250))
        sun, sun_y = (255, 230, 120), 26
        far, near, crown = (90, 160, 80), (60, 130, 60), (40, 120, 50)
    draw = ImageDraw.Draw(img)
    draw.ellipse([sun_x - 12, sun_y - 12, sun_x + 12, sun_y + 12], fill=sun)
    _hills(draw, far, near, shift)
    _tree(draw, 52 - shift // 2, crown)
    return img


def first_frame() -> Image.Image:
    return _landscape(sunset=False)


def last_frame() -> Image.Image:
    return _landscape(sunset=True, sun_x=120)


def _character(body: tuple, ears: bool) -> Image.Image:
    """A round cartoon subject on a white background, for the reference-to-video workflow."""
    img = Image.new("RGB", (WIDTH, HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cx, cy = WIDTH // 2, 66
    if ears:
        draw.polygon([(cx - 30, cy - 20), (cx - 20, cy - 50), (cx - 6, cy - 30)], fill=body)
        draw.polygon([(cx + 30, cy - 20), (cx + 20, cy - 50), (cx + 6, cy - 30)], fill=body)
    draw.ellipse([cx - 34, cy - 34, cx + 34, cy + 34], fill=body)
    for dx in (-12, 12):
        draw.ellipse([cx + dx - 7, cy - 14, cx + dx + 7, cy], fill=(255, 255, 255))
        draw.ellipse([cx + dx - 3, cy - 9, cx + dx + 3, cy - 3], fill=(20, 20, 20))
    draw.arc([cx - 12, cy + 2, cx + 12, cy + 18], 20, 160, fill=(20, 20, 20), width=2)
    return img


def reference_1() -> Image.Image:
    return _character((220, 60, 50), ears=False)


def reference_2() -> Image.Image:
    return _character((60, 110, 220), ears=True)


def inpaint_mask() -> Image.Image:
    """White = repaint: a round patch of sky above the hills."""
    img = Image.new("RGB", (WIDTH, HEIGHT), (0, 0, 0))
    ImageDraw.Draw(img).ellipse([80, 14, 128, 62], fill=(255, 255, 255))
    return img


def _pose_frame(i: int) -> np.ndarray:
    """A stick figure that waves its arms and steps sideways, drawn like a pose-estimation control video."""
    img = Image.new("RGB", (WIDTH, HEIGHT), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    t = i / (FRAMES - 1)
    swing = math.cos(2 * math.pi * 3 * t)  # three waves of the arms in the 5 s
    cx = round(WIDTH / 2 + 30 * math.sin(math.pi * t) - 15)
    head, neck, hip = (cx, 24), (cx, 36), (cx, 70)
    limbs = {
        "arm_l": [(cx - 16, 44 - 14 * swing), (cx - 26, 30 - 20 * swing)],
        "arm_r": [(cx + 16, 44 + 14 * swing), (cx + 26, 30 + 20 * swing)],
        "leg_l": [(cx - 10, 90), (cx - 12 - 6 * swing, 112)],
        "leg_r": [(cx + 10, 90), (cx + 12 - 6 * swing, 112)],
    }
    colors = {"arm_l": (255, 170, 0), "arm_r": (0, 200, 255), "leg_l": (255, 60, 120), "leg_r": (120, 255, 60)}
    draw.line([neck, hip], fill=(255, 255, 255), width=4)
    for name, (mid, end) in limbs.items():
        start = neck if name.startswith("arm") else hip
        draw.line([start, mid, end], fill=colors[name], width=4, joint="curve")
    draw.ellipse([head[0] - 9, head[1] - 9, head[0] + 9, head[1] + 9], fill=(255, 255, 255))
    return np.asarray(img)


def _source_frame(i: int) -> np.ndarray:
    """The landscape with the camera panning right and a small bird crossing the sky."""
    t = i / (FRAMES - 1)
    img = _landscape(sunset=False, shift=round(24 * t), sun_x=round(150 - 12 * t))
    draw = ImageDraw.Draw(img)
    bx, by = round(20 + 150 * t), round(40 - 10 * math.sin(math.pi * t))
    wing = 5 if i % 4 < 2 else -3
    draw.line([(bx - 8, by - wing), (bx, by), (bx + 8, by - wing)], fill=(30, 30, 30), width=2)
    return np.asarray(img)


def write_video(path: Path, frames: list[np.ndarray], fps: int = FPS) -> None:
    import av

    height, width = frames[0].shape[:2]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        # No B-frames keeps decoded frame count exact; crf 20 is visually clean for flat drawings.
        stream.options = {"crf": "20", "bf": "0", "preset": "medium"}
        for arr in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


IMAGES: dict[str, Callable[[], Image.Image]] = {
    "wanvace_example_first.png": first_frame,
    "wanvace_example_last.png": last_frame,
    "wanvace_example_ref1.png": reference_1,
    "wanvace_example_ref2.png": reference_2,
    "wanvace_example_mask.png": inpaint_mask,
}
VIDEOS: dict[str, Callable[[int], np.ndarray]] = {
    "wanvace_example_control.mp4": _pose_frame,
    "wanvace_example_source.mp4": _source_frame,
}
NAMES = (*IMAGES, *VIDEOS)


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in IMAGES.items():
        path = out_dir / name
        make().save(path, optimize=True)
        written.append(path)
    for name, frame in VIDEOS.items():
        path = out_dir / name
        write_video(path, [frame(i) for i in range(FRAMES)])
        written.append(path)
    return written


# --- checking ----------------------------------------------------------------


def _decode(path: Path) -> tuple[list[np.ndarray], float]:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return frames, float(stream.average_rate)


def differences(expected_dir: Path, actual_dir: Path) -> list[str]:
    """What differs between freshly generated files (expected_dir) and the committed ones (actual_dir)."""
    problems = []
    for name in IMAGES:
        path = actual_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        want = np.asarray(Image.open(expected_dir / name).convert("RGB"))
        have = np.asarray(Image.open(path).convert("RGB"))
        if want.shape != have.shape or not np.array_equal(want, have):
            problems.append(f"{name}: pixels differ")
    for name in VIDEOS:
        path = actual_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        want, want_fps = _decode(expected_dir / name)
        have, have_fps = _decode(path)
        if len(want) != len(have) or want_fps != have_fps:
            problems.append(f"{name}: {len(have)} frames at {have_fps} fps, expected {len(want)} at {want_fps}")
            continue
        for index, (a, b) in enumerate(zip(want, have, strict=True)):
            if a.shape != b.shape:
                problems.append(f"{name}: frame {index} is {b.shape}, expected {a.shape}")
                break
            diff = float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())
            if diff > VIDEO_TOLERANCE:
                problems.append(f"{name}: frame {index} differs by {diff:.2f} on average")
                break
    extra = sorted(p.name for p in actual_dir.iterdir() if p.name not in NAMES) if actual_dir.is_dir() else []
    problems += [f"{name}: not generated by this script" for name in extra]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed file differs")
    parser.add_argument("--out", type=Path, default=EXAMPLE_DIR, help=f"folder (default {EXAMPLE_DIR})")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory(prefix="wanvace-examples-") as tmp:
            write_all(Path(tmp))
            problems = differences(Path(tmp), args.out)
        for line in problems:
            print(f"out of date: {line}")
        return 1 if problems else 0
    for path in write_all(args.out):
        print(f"{path}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
