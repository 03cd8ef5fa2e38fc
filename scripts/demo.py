"""Runs a shipped workflow through a real ComfyUI on the built-in tiny model and prints where the video is.

Run it through `bash scripts/demo.sh`, which sets up the ComfyUI and the venv this runs in. The ComfyUI base folder
is .cache/demo (models, inputs, outputs, server.log); the tiny model is written there on first use. The workflow is
example_workflows/api/wanvace_<task>.json, the API twin of the shipped template, sized down for the tiny model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The standard library only, up to the arguments: scripts/demo.sh checks them with the system Python before set-up.
from workflow_graphs import TASKS  # noqa: E402

# ComfyUI's own default port.
DEFAULT_PORT = 8188


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bash scripts/demo.sh",
        description="Set up one ComfyUI and its venv, run a shipped workflow on the built-in tiny model (random "
        "weights: the video is noise), and print where the video is.",
    )
    parser.add_argument("--task", choices=TASKS, default="t2v", help="the workflow to run (default: t2v)")
    parser.add_argument(
        "--port",
        type=_port,
        help=f"the port ComfyUI listens on, at 127.0.0.1 (default: {DEFAULT_PORT}, ComfyUI's own; "
        "a free one where that is taken)",
    )
    parser.add_argument(
        "--base-dir", type=Path, default=REPO / ".cache" / "demo", help="ComfyUI's base folder (default: .cache/demo)"
    )
    parser.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.port is not None and _in_use(args.port):
        parser.error(f"--port {args.port}: something listens there already; choose another port")
    return args


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.check_args:
        print("run")
        return 0

    # torch 2.8 warns at import, on every machine without CUDA, about an autocast some import declares for CUDA.
    warnings.filterwarnings("ignore", message="User provided device_type of 'cuda', but CUDA is not available")
    import av
    import transformers

    from scripts.comfy_server import ComfyServer, write_example_inputs
    from wanvace_core.load.tiny import write_tiny_pipeline
    from workflow_graphs import TINY_MODEL, for_tiny_model

    transformers.utils.logging.disable_progress_bar()

    port = args.port
    if port is None and not _in_use(DEFAULT_PORT):
        port = DEFAULT_PORT
    server = ComfyServer(args.base_dir, port=port)
    server.prepare()
    model_dir = server.base_dir / "models" / "diffusers" / TINY_MODEL
    if not (model_dir / "model_index.json").is_file():
        _say(f"writing the tiny model (random weights) to {model_dir}")
        shutil.rmtree(model_dir, ignore_errors=True)
        write_tiny_pipeline(model_dir)
    write_example_inputs(server.base_dir / "input")
    workflow_file = REPO / "example_workflows" / "api" / f"wanvace_{args.task}.json"
    workflow = for_tiny_model(json.loads(workflow_file.read_text()))

    comfy_dir = server.comfy_dir.resolve()
    _say(f"starting ComfyUI at {comfy_dir} (log: {server.log_path})")
    with server:
        version = server.system_stats()["system"].get("comfyui_version", "unknown")
        moved = "" if server.port == (args.port or DEFAULT_PORT) else f" ({DEFAULT_PORT} is taken)"
        _say(f"ComfyUI {version} answers on {server.url}{moved}; running {workflow_file.relative_to(REPO)}")
        result = server.run_prompt(workflow)
    if result.status != "success":
        error = result.error or {}
        detail = error.get("exception_message") or json.dumps(result.response)[:2000]
        _say(f"the {args.task} workflow ended with status {result.status}: {detail.strip()}")
        _say(f"ComfyUI's log: {server.log_path}")
        return 1
    videos = [path for path in result.output_files() if path.suffix in (".mp4", ".webm", ".webp")]
    if not videos:
        _say(f"the {args.task} workflow finished but wrote no video; outputs: {result.outputs}")
        return 1
    for video in videos:
        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            size = f"{stream.codec_context.width}x{stream.codec_context.height}"
            frames = sum(1 for _ in container.decode(video=0))
        _say(f"video: {video} ({frames} frames, {size})")
    _say(f"ran on ComfyUI {version} at {comfy_dir}; the workflow took {result.duration_s:.1f} s")
    _say("the tiny model's weights are random, so the video is noise: the point is that the whole pipeline runs.")
    _say('for real videos, install the pack into your ComfyUI and get the weights (README: "Weights").')
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
