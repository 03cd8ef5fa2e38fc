from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.distributed import threads_of_workers  # noqa: E402
from wanvace_core import load_pipeline  # noqa: E402
from wanvace_core.tiny import TinyModelSpec, write_tiny_pipeline  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


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
