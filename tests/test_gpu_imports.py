"""The GPU check must import on the machine it was written for: every distribution bench/gpu_check.sh imports (the
library's, the GPU benches', the gpu-marked tests' and their helpers', lazy imports included, and what ComfyUI's
`comfy` modules load for the fast path's ComfyUI row) is on the lent H200 machine (bench/h200_packages.txt, from the
device library's KINDS.md) or among the wheels bench/gpu_wheels.sh downloads (bench/gpu_wheels.lock.json), and that
lock is a resolution of its inputs. No network, no GPU. (bench/gpu_dry_run.sh runs the whole check offline in a
Python 3.12 venv of the machine's versions; it stays outside CI: a 5 GB venv.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import gpu_check, gpu_imports
from bench.gpu_imports import REPO, Import

CURRENT_TREE = REPO / ".cache" / "comfyui-current"


def _requirement(text: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(text)


def test_every_import_of_the_gpu_check_is_on_the_h200_or_among_the_wheels():
    found = gpu_imports.all_imports()
    files = {item.file for item in found}
    # The walk reaches what gpu_check.sh runs: the gpu-marked tests, their helpers, the benches they share code with.
    for name in (
        "tests/test_parallel_gpu.py",
        "tests/support/vace_tasks.py",
        "bench/comfy_wan.py",
        "bench/gpu_probe.py",
    ):
        assert REPO / name in files, name
    problems = gpu_imports.problems(found, gpu_imports.machine_packages(), gpu_imports.locked_wheels())
    assert not problems, "\n".join(problems)


def test_the_guard_fails_on_an_import_the_h200_lacks(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import av\nimport xformers.ops\n\n\ndef later():\n    import av\n    import flash_attn\n")
    found = gpu_imports.all_imports() + gpu_imports.imports_in(planted)
    problems = gpu_imports.problems(found, gpu_imports.machine_packages(), gpu_imports.locked_wheels())
    assert len(problems) == 3, problems
    av, flash_attn, xformers = problems
    assert av.startswith("av is optional") and "planted.py:1" in av and "planted.py:6" not in av
    assert flash_attn.startswith("flash_attn (distribution flash-attn) is neither")
    assert "planted.py:7 (lazy)" in flash_attn
    assert xformers.startswith("xformers (distribution xformers) is neither") and "planted.py:2" in xformers


def test_optional_modules_are_imported_only_inside_functions():
    lazy = [item for item in gpu_imports.all_imports() if item.top in gpu_imports.OPTIONAL]
    assert lazy and all(item.lazy for item in lazy), [item.where() for item in lazy if not item.lazy]
    assert {item.file.name for item in lazy} >= {"generate.py", "vace_tasks.py"}


def test_the_wheel_lock_is_a_resolution_of_its_inputs(tmp_path):
    """What `bash bench/gpu_wheels.sh --lock` would write, checked offline: each root and each wheel's Requires-Dist
    is met by the lock or the machine, the pins are kept, nothing the machine already has is carried, one version of
    each, and the wheels fit the device tool's carry limit."""
    machine = gpu_imports.machine_packages()
    lock = json.loads(gpu_imports.WHEEL_LOCK.read_text())
    names = [gpu_imports.canonical(entry["name"]) for entry in lock["wheels"]]
    assert len(names) == len(set(names)), names
    wheels = gpu_imports.locked_wheels()
    needs: dict[str, list] = {}
    unmet = []
    # For the ComfyUI the lock is made for (a tree without requirements: gpu_check.COMFY_TOOL_PINS, 0.33's), not the
    # set's tree, which may be a newer ComfyUI pinning other comfy-kitchen versions (gpu_wheels.sh then asks for
    # --lock: the test below).
    roots = gpu_check.roots(tmp_path)
    requires = [(text, f"{entry['name']} {entry['version']}") for entry in lock["wheels"] for text in entry["requires"]]
    locked_roots = [root["requirement"] for root in lock["roots"]]
    assert locked_roots == [text for text, _ in roots], "the inputs changed: run bench/gpu_wheels.sh --lock"
    for text, why in roots + requires:
        requirement = _requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(gpu_check.TARGET_MARKERS):
            continue
        name = gpu_imports.canonical(requirement.name)
        needs.setdefault(name, []).append(requirement)
        entry = wheels.get(name)
        if entry is not None:
            if not requirement.specifier.contains(entry["version"], prereleases=True):
                unmet.append(f"{text} (for {why}): the lock has {entry['version']}")
        elif not gpu_check.satisfied_by_machine(requirement, machine):
            unmet.append(f"{text} (for {why}): neither in the lock nor on the machine ({machine.get(name, 'absent')})")
    assert not unmet, "\n".join(unmet)
    for name, pin in gpu_check.pins().items():
        if name in wheels:
            assert wheels[name]["version"] == pin, f"{name}: the lock has {wheels[name]['version']}, the set pins {pin}"
    carried = [
        name for name in wheels if all(gpu_check.satisfied_by_machine(req, machine) for req in needs.get(name, []))
    ]
    assert not carried, f"the machine already has {carried}: bench/gpu_wheels.sh --lock leaves them out"
    assert not [entry["file"] for entry in lock["wheels"] if not entry["pure"]], "binary wheels: CPython 3.12 only"
    assert 0 < lock["bytes"] < gpu_check.WHEELS_LIMIT_BYTES
    assert {"diffusers", "cache-dit", "gguf", "comfy-kitchen", "sageattention"} <= set(wheels)


def test_gpu_wheels_refuses_a_comfyui_tree_the_lock_was_not_resolved_for(tmp_path, monkeypatch, capsys):
    """A newer ComfyUI pins other comfy-kitchen / comfy-aimdo versions than the lock's (0.38: 0.2.36 and 0.5.5): its
    comfy package must not travel with wheels resolved for 0.33's, and nothing is downloaded."""
    tree = tmp_path / "ComfyUI"
    tree.mkdir()
    (tree / "requirements.txt").write_text(
        "comfyui-frontend-package==1.53.6\ncomfy-kitchen==0.2.36\ncomfy-aimdo==0.5.5\n"
    )
    monkeypatch.setenv("WANVACE_COMFY_DIR", str(tree))
    monkeypatch.setattr(gpu_check, "download_locked", lambda *_: pytest.fail("downloaded a lock that does not fit"))
    dest = tmp_path / "wheels"
    assert gpu_check.wheels(dest, lock_again=False, has_file=None) == 1
    said = capsys.readouterr().out
    assert "resolved without comfy-kitchen==0.2.36, comfy-aimdo==0.5.5" in said and "gpu_wheels.sh --lock" in said
    assert not dest.exists()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("WANVACE_SET", "current") != "current" or not CURRENT_TREE.exists(),
    reason="the wheels and ComfyUI's row are the current set's (ComfyUI 0.33)",
)
def test_importing_our_modules_and_comfyuis_row_loads_only_h200_or_wheel_distributions():
    """What the imports really run, module-level chains included: ComfyUI's `comfy` modules (from the tree
    gpu_wheels.sh copies) import comfy_kitchen and comfy_aimdo; the wheels' packages (diffusers, cache-dit, ...) import
    what they need. Run in a fresh interpreter of this venv; the mapping to distributions is this venv's."""
    stale = gpu_check.stale_roots(json.loads(gpu_imports.WHEEL_LOCK.read_text()), CURRENT_TREE)
    if stale:
        pytest.skip(f"SKIPPED: the wheels are resolved for another ComfyUI than {CURRENT_TREE} ({', '.join(stale)})")
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.gpu_runtime_imports", "--comfy", str(CURRENT_TREE)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["failed"], report["failed"]
    assert {"comfy_kitchen", "comfy_aimdo"} <= set(report["loaded"]["comfy"])
    machine, wheels = gpu_imports.machine_packages(), gpu_imports.locked_wheels()
    missing = []
    for stage, loaded in report["loaded"].items():
        for top, importers in loaded.items():
            dists = gpu_imports.distributions(top)
            if top not in gpu_imports.OPTIONAL and gpu_imports.source_of(dists, machine, wheels) is None:
                missing.append(f"{top} ({'/'.join(dists)}; {stage}: imported by {', '.join(importers)})")
    assert not missing, "loaded, but neither on the H200 machine nor among the wheels:\n" + "\n".join(missing)


def test_the_import_walk_follows_lazy_imports_and_counts_ours_as_no_distribution(tmp_path):
    source = "import torch\n\n\ndef f():\n    from diffusers.hooks import apply_group_offloading\n"
    (tmp_path / "module.py").write_text(source)
    found = gpu_imports.imports_in(tmp_path / "module.py")
    assert [(item.module, item.lazy) for item in found] == [
        ("torch", False),
        ("diffusers.hooks", True),
        ("diffusers.hooks.apply_group_offloading", True),
    ]
    ours = ("tests.support.vace_tasks", "bench.rss", "scripts.comfy_server", "workflow_graphs", "wanvace_core.hooks")
    assert gpu_imports.third_party([Import(name, REPO / "tests" / "test_x.py", 1, False) for name in ours]) == []
