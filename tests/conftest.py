from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.distributed import RankPools, threads_of_workers  # noqa: E402
from tests.support.single_files import ComfyModels, comfy_components, write_comfy_models  # noqa: E402
from wanvace_core import load_pipeline  # noqa: E402
from wanvace_core.load.tiny import COMFY_SHAPED, TinyModelSpec, write_tiny_pipeline  # noqa: E402

# Under scripts/test.sh's pytest-xdist workers the cores are shared out: more threads than that only contend.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads(), (os.cpu_count() or 1) // _WORKERS)))

# The current set runs every test in every variant. The oldest set proves each feature works on the oldest
# dependencies: each parametrized test runs its first variant there (every variant where it is marked
# `every_variant`), and tests marked `one_set` are left to the current set. WANVACE_FULL=1 runs all in both.
TRIMMED_SET = "oldest"


def _trimmed() -> bool:
    return os.environ.get("WANVACE_SET") == TRIMMED_SET and os.environ.get("WANVACE_FULL") != "1"


def pytest_report_header(config):
    if _trimmed():
        return (
            f"{TRIMMED_SET} set: first variant of each parametrized test (all where marked every_variant), "
            "no one_set tests; WANVACE_FULL=1 runs them all"
        )
    return None


def pytest_collection_modifyitems(config, items):
    if not _trimmed():
        return
    kept, left_out = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        later_variant = callspec is not None and any(index != 0 for index in callspec.indices.values())
        dropped = item.get_closest_marker("one_set") or (later_variant and not item.get_closest_marker("every_variant"))
        (left_out if dropped else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_pipeline(tmp_path_factory.mktemp("models") / "wanvace-tiny")


@pytest.fixture(scope="session")
def tiny_single_folder(tmp_path_factory) -> Path:
    return write_tiny_pipeline(
        tmp_path_factory.mktemp("models") / "wanvace21-tiny", TinyModelSpec(two_experts=False, seed=1)
    )


@pytest.fixture(scope="session")
def loaded_models(tiny_folder):
    """Our loaded pipelines, one per dtype, shared across tests (loading is what we test elsewhere)."""
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = load_pipeline(tiny_folder, dtype)
        return cache[dtype]

    return get


@pytest.fixture(scope="module")
def threads_like_two_workers():
    """The module computes on as many threads as each of two CPU workers (see `threads_of_workers`)."""
    with threads_of_workers(2):
        yield


@pytest.fixture(scope="module")
def rank_pools():
    """`rank_pools(world)`: this module's gloo ranks of that world size, spawned on first use and reused by the
    module's later runs (`tests.support.distributed.RankPool`); stopped after the module."""
    pools = RankPools()
    yield pools
    pools.close()


# --------------------------------------------------------------------------------------------------
# The COMFY_SHAPED tiny model and its single files, built once per session. Shared by every module that
# asks: never modify them. A test that edits, truncates or re-saves a file works on a copy in its tmp_path.


def _file_states(root: Path) -> dict[str, tuple[int, int]]:
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in root.rglob("*") if path.is_file()}


@pytest.fixture(scope="session")
def comfy_components_default() -> dict:
    """`tests.support.single_files.comfy_components()`: the COMFY_SHAPED components (transformer, transformer_2,
    text_encoder, vae, ...) the single files are written from. Read them; do not change their weights."""
    return comfy_components()


@pytest.fixture(scope="session")
def comfy_shaped_folder(tmp_path_factory) -> Path:
    """The diffusers folder of the same COMFY_SHAPED model (`write_tiny_pipeline(..., COMFY_SHAPED)`): the same
    weights as `comfy_components_default`. Read-only, like `comfy_model_files`."""
    folder = write_tiny_pipeline(tmp_path_factory.mktemp("diffusers") / "wanvace-comfy-shaped", COMFY_SHAPED)
    states = _file_states(folder)
    yield folder
    assert _file_states(folder) == states, f"a test changed the shared folder {folder}; work on a copy"


@pytest.fixture(scope="session")
def comfy_model_files(tmp_path_factory, comfy_components_default) -> ComfyModels:
    """A ComfyUI `models/` tree of every single-file format, `write_comfy_models(root, comfy_components_default)`:
    `.root` (the models/ folder) and `.written` (what write_comfy_models returns: `written["bf16"]["high"]`,
    `written["split"]["low"]["vace"]`, `written["umt5_fp16"]`, `written["vae"]`, ...). Read-only: checked
    unchanged at the end of the session."""
    root = tmp_path_factory.mktemp("comfy") / "models"
    written = write_comfy_models(root, comfy_components_default)
    states = _file_states(root)
    yield ComfyModels(root, written)
    assert _file_states(root) == states, f"a test changed the shared files under {root}; work on a copy"
