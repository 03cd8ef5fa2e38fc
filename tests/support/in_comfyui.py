"""Running a test module's code inside a ComfyUI tree, in a subprocess: ComfyUI's `comfy` package imports only there
(its `nodes.py` shadows this repository's `nodes`), so the pack is loaded as the package `wanvace_pack`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from scripts.comfy_server import DEFAULT_COMFY_DIR
from tests.support.comfyui import COMFY_SKIPPED

REPO = Path(__file__).resolve().parents[2]


def enter_comfyui() -> None:
    """In the subprocess: ComfyUI's tree first on the path, its CPU arguments, the pack as `wanvace_pack`."""
    sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository's own `nodes` package
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import_pack(str(REPO))


def import_pack(repo: str) -> None:
    """The pack as the package `wanvace_pack`, with an empty `nodes` package (its __init__ imports every node;
    the name `nodes` itself is ComfyUI's nodes.py here)."""
    spec = importlib.util.spec_from_file_location(
        "wanvace_pack", os.path.join(repo, "__init__.py"), submodule_search_locations=[repo]
    )
    sys.modules["wanvace_pack"] = importlib.util.module_from_spec(spec)
    nodes_package = types.ModuleType("wanvace_pack.nodes")
    nodes_package.__path__ = [os.path.join(repo, "nodes")]
    sys.modules["wanvace_pack.nodes"] = nodes_package


def run_in_comfyui(script: str, tiny_folder: Path, out_dir: Path):
    """In the test process: `python script tiny_folder out.pt` in the set's ComfyUI tree (skipped without one), with
    this process's torch threads (tests/conftest.py shares the cores out among pytest-xdist workers; with more, the
    run's tiny matmuls wait on each other); what it saved."""
    if COMFY_SKIPPED or not (DEFAULT_COMFY_DIR / "comfy").is_dir():
        pytest.skip(f"SKIPPED: no ComfyUI tree for this dependency set ({COMFY_SKIPPED or DEFAULT_COMFY_DIR})")
    out = out_dir / "out.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    command = [sys.executable, str(Path(script).resolve()), str(tiny_folder), str(out)]
    done = subprocess.run(command, cwd=DEFAULT_COMFY_DIR, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the run in ComfyUI failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max())
