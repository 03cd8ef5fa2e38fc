"""Runs a shipped workflow through a real ComfyUI on the built-in tiny model and prints the video path.

    .venvs/current/bin/python scripts/demo.py [--task t2v|i2v|flf2v|r2v|v2v|inpaint|outpaint|extension]

The ComfyUI base folder is .cache/demo (models, inputs, outputs, server.log); the tiny model is
written there on first use. The workflow is example_workflows/api/wanvace_<task>.json, the API twin
of the shipped example_workflows/WanVACE - <Task>.json, sized down for the tiny model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from comfy_server import ComfyServer, count_video_frames, write_example_inputs  # noqa: E402
from workflow_graphs import TINY_MODEL, WORKFLOWS, for_tiny_model  # noqa: E402

from wanvace_core.load.tiny import write_tiny_pipeline  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=WORKFLOWS, default="t2v")
    parser.add_argument("--base-dir", type=Path, default=REPO / ".cache" / "demo")
    args = parser.parse_args()

    server = ComfyServer(args.base_dir)
    server.prepare()
    model_dir = args.base_dir / "models" / "diffusers" / TINY_MODEL
    if not (model_dir / "model_index.json").is_file():
        shutil.rmtree(model_dir, ignore_errors=True)
        write_tiny_pipeline(model_dir)
    write_example_inputs(args.base_dir / "input")
    workflow = json.loads((REPO / "example_workflows" / "api" / f"wanvace_{args.task}.json").read_text())
    print(f"starting ComfyUI (log: {server.log_path})", flush=True)
    with server:
        server.start()
        result = server.run_prompt(for_tiny_model(workflow))
    if result.status != "success":
        print(f"workflow {args.task} ended with status {result.status}: {result.error or result.response}")
        return 1
    videos = [path for path in result.output_files() if path.suffix in (".mp4", ".webm", ".webp")]
    steps = len(result.progress_events())
    for video in videos:
        print(f"{args.task}: {count_video_frames(video)} frames, {steps} progress events, {result.duration_s:.1f} s")
        print(f"video written: {video}")
    return 0 if videos else 1


if __name__ == "__main__":
    raise SystemExit(main())
