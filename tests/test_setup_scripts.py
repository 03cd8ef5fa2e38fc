"""scripts/setup.sh picks the ComfyUI a clone is installed in (custom_nodes/<clone>) and refuses one we do not test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clone_in_comfyui(tmp_path: Path, version: str | None) -> Path:
    """The scripts of this repository as a pack inside a ComfyUI tree of `version` (None: no version file)."""
    comfy = tmp_path / "ComfyUI"
    pack = comfy / "custom_nodes" / "ComfyUI-WanVACE"
    shutil.copytree(REPO / "scripts", pack / "scripts")
    shutil.copy(REPO / "requirements.txt", pack / "requirements.txt")
    (comfy / "main.py").write_text("")
    if version is not None:
        (comfy / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    return pack


def _setup_current(pack: Path, **env) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "COMFYUI_DIR"}
    # A venv root of its own: a refusal must come before any venv is looked at.
    environment.update(WANVACE_VENV_ROOT=str(pack / "venvs"), **env)
    return subprocess.run(
        ["bash", "scripts/setup.sh", "current"], cwd=pack, env=environment, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("version", ["0.3.75", "0.34.0", None])
def test_a_comfyui_we_do_not_test_is_named_and_refused(tmp_path, version):
    pack = _clone_in_comfyui(tmp_path, version)
    result = _setup_current(pack)
    assert result.returncode == 1, result.stdout + result.stderr
    comfy = pack.parent.parent
    named = version or "unknown (no comfyui_version.py)"
    assert f"the ComfyUI at {comfy} is version {named}; the current set is tested with 0.33.x" in result.stderr
    assert "this clone is in its custom_nodes folder" in result.stderr
    assert not (pack / "venvs").exists() and not (pack / ".cache" / "comfyui-current").exists()


def test_comfyui_dir_wins_over_the_enclosing_comfyui(tmp_path):
    pack = _clone_in_comfyui(tmp_path, "0.33.0")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "main.py").write_text("")
    (elsewhere / "comfyui_version.py").write_text('__version__ = "0.2.0"\n')
    result = _setup_current(pack, COMFYUI_DIR=str(elsewhere))
    assert result.returncode == 1
    assert f"COMFYUI_DIR: the ComfyUI at {elsewhere} is version 0.2.0" in result.stderr
