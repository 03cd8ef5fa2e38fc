"""What bench/gpu_check.sh imports, and where each distribution comes from on the H200 machine.

    python3 bench/gpu_imports.py list                 # every import the GPU check makes, by distribution
    python3 bench/gpu_imports.py check                # fails unless each is on the H200 or among the wheels

The files are the ones gpu_check.sh runs: the library (`wanvace_core/`), the GPU benches and every `bench.` module they
import, `tests/conftest.py` and the gpu-marked test files with the helpers they import (`tests.support.`, `bench.`,
`scripts.`, `workflow_graphs`).
Every import statement counts, module-level or inside a function (lazy), except the `OPTIONAL` modules, which
may appear only inside functions that no GPU step calls. ComfyUI's `comfy` package is not a distribution: the
fast path's ComfyUI row imports the modules the benches name from the ComfyUI tree that bench/gpu_wheels.sh
copies; what importing all of them really loads is tests/test_gpu_imports.py's (through
tests/support/gpu_runtime_imports.py, since it imports the test modules too).

A distribution is available when bench/h200_packages.txt (the machine's python3, from the device library's
KINDS.md) or bench/gpu_wheels.lock.json (what bench/gpu_wheels.sh downloads) names it. No network, no torch:
`list` and `check` read source files only (the module -> distribution map is this Python's installed metadata,
then `DISTRIBUTION_OF`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H200_PACKAGES = REPO / "bench" / "h200_packages.txt"
WHEEL_LOCK = REPO / "bench" / "gpu_wheels.lock.json"
OURS = ("wanvace_core", "tests", "bench", "scripts", "workflow_graphs")
COMFY = "comfy"  # ComfyUI's package: from the tree gpu_wheels.sh copies, not a distribution
# The benches bench/gpu_check.sh runs (the modules of ours each imports are followed from these).
GPU_BENCHES = (
    "gpu_probe.py",
    "bench_offload_gpu.py",
    "bench_single_file_gpu.py",
    "bench_parallel_gpu.py",
    "bench_vae_tiling.py",
    "bench_fast_path_gpu.py",
)
# Imported by no import statement of ours: diffusers' Wan pipelines clean prompts with ftfy when it is installed,
# pytest loads pytest-timeout as a plugin (`-p pytest_timeout`), the parallel bench runs torch.distributed.run, and
# ComfyUI's `comfy.ldm.modules.attention` runs SageAttention when `sageattention` imports (the ComfyUI row's best).
EXTRA_MODULES = ("ftfy", "pytest", "pytest_timeout", "torch.distributed.run", "sageattention")
# Modules the H200 lacks that GPU code never needs: allowed only inside functions (tests/test_gpu_imports.py).
OPTIONAL = {
    "av": "writes and reads MP4s (the offline command's output, tests/support/vace_tasks.lossless_video); no GPU step "
    "touches a video file"
}
# Where the module's name is not its distribution's and this Python has not installed it.
DISTRIBUTION_OF = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "cv2": "opencv-python-headless",
    "google": "protobuf",
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "_pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "typing_extensions": "typing-extensions",
    "huggingface_hub": "huggingface-hub",
    "cache_dit": "cache-dit",
    "comfy_kitchen": "comfy-kitchen",
    "comfy_aimdo": "comfy-aimdo",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Import:
    module: str  # as written: "diffusers.hooks"
    file: Path
    line: int
    lazy: bool  # inside a function body: runs only when the function does

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def where(self) -> str:
        shown = self.file.relative_to(REPO) if self.file.is_relative_to(REPO) else self.file
        return f"{shown}:{self.line}{' (lazy)' if self.lazy else ''}"


def imports_in(path: Path) -> list[Import]:
    """Every absolute import of `path` (`from x import y` also as `x.y`), noting those inside a function."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, path, child.lineno, lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module != "__future__":
                found.append(Import(child.module, path, child.lineno, lazy))
                found.extend(
                    Import(f"{child.module}.{alias.name}", path, child.lineno, lazy)
                    for alias in child.names
                    if alias.name != "*"
                )
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def gpu_test_files() -> list[Path]:
    """The test files with a `pytest.mark.gpu` test (what gpu_check.sh hands to pytest)."""
    return sorted(path for path in (REPO / "tests").glob("test_*.py") if "pytest.mark.gpu" in path.read_text())


def _own_file(module: str) -> Path | None:
    """The file of one of our modules (`bench.x`, `tests.support.x`, a package's `__init__.py`), else None (a name
    imported from a module, another distribution). Every import of ours names its module from the repository's root."""
    parts = module.split(".")
    if parts[0] not in OURS:
        return None
    path = REPO.joinpath(*parts)
    return next((file for file in (path.with_suffix(".py"), path / "__init__.py") if file.is_file()), None)


def checked_files() -> list[Path]:
    """The files whose imports the GPU check makes: ours, followed from the benches and the gpu-marked tests."""
    queue = sorted((REPO / "wanvace_core").rglob("*.py")) + [REPO / "bench" / name for name in GPU_BENCHES]
    queue += [REPO / "tests" / "conftest.py", *gpu_test_files()]
    seen: list[Path] = []
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for found in imports_in(path):
            helper = _own_file(found.module)
            if helper is not None:
                queue.append(helper)
    return seen


def all_imports() -> list[Import]:
    files = checked_files()
    found = [found for path in files for found in imports_in(path)]
    found += [Import(module, Path(__file__), 0, False) for module in EXTRA_MODULES]
    return found


def third_party(found: list[Import]) -> list[Import]:
    """The imports of distributions: not the standard library, not ours, not ComfyUI's tree."""
    return [item for item in found if item.top not in sys.stdlib_module_names and item.top not in (*OURS, COMFY)]


def comfy_modules(found: list[Import], tree: Path) -> list[str]:
    """The ComfyUI modules the benches import (the fast path's ComfyUI row) that are modules of `tree` (not names
    imported from one), in a stable order."""
    names = set()
    for item in found:
        path = tree.joinpath(*item.module.split("."))
        if item.top == COMFY and (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
            names.add(item.module)
    return sorted(names)


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    import importlib.metadata

    return importlib.metadata.packages_distributions()


def distributions(top: str) -> list[str]:
    """The distributions that may provide the top-level module `top` (canonical names)."""
    installed = _installed_distributions().get(top)
    if installed:
        return sorted({canonical(name) for name in installed})
    return [canonical(DISTRIBUTION_OF.get(top, top))]


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def machine_packages(path: Path = H200_PACKAGES) -> dict[str, str | None]:
    """bench/h200_packages.txt: canonical name -> version (None where the list gives none)."""
    packages: dict[str, str | None] = {}
    for line in _requirement_lines(path):
        name, _, version = line.partition("==")
        packages[canonical(name)] = version.strip() or None
    return packages


def locked_wheels(path: Path = WHEEL_LOCK) -> dict[str, dict]:
    """bench/gpu_wheels.lock.json's wheels: canonical name -> its entry."""
    if not path.exists():
        return {}
    return {canonical(entry["name"]): entry for entry in json.loads(path.read_text())["wheels"]}


def source_of(dists: list[str], machine: dict, wheels: dict) -> str | None:
    """'wheels' or 'machine' for the first distribution available, else None."""
    for dist in dists:
        if dist in wheels:
            return "wheels"
        if dist in machine:
            return "machine"
    return None


def problems(found: list[Import], machine: dict, wheels: dict) -> list[str]:
    """Why the GPU check would fail to import on the H200: missing distributions and optional modules imported
    at module level. Empty when every import is covered."""
    out = []
    by_top: dict[str, list[Import]] = {}
    for item in third_party(found):
        by_top.setdefault(item.top, []).append(item)
    for top, items in sorted(by_top.items()):
        if top in OPTIONAL:
            eager = [item for item in items if not item.lazy]
            if eager:
                out.append(
                    f"{top} is optional on the GPU machine ({OPTIONAL[top]}) but imported at module level: "
                    f"{', '.join(item.where() for item in eager)}; import it inside the function that needs it"
                )
            continue
        dists = distributions(top)
        if source_of(dists, machine, wheels) is None:
            where = ", ".join(sorted({item.where() for item in items})[:4])
            out.append(
                f"{top} (distribution {' or '.join(dists)}) is neither on the H200 machine (bench/h200_packages.txt) "
                f"nor among the wheels (bench/gpu_wheels.lock.json); imported at {where}. Add it to the wheels "
                "(bench/gpu_wheels.sh --lock) or import it only where GPU code does not run."
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every third-party import, with its distribution and source")
    commands.add_parser("check", help="exit 1 unless every import is on the H200 or among the wheels")
    args = parser.parse_args()
    found = all_imports()
    machine, wheels = machine_packages(), locked_wheels()
    if args.command == "list":
        by_top: dict[str, list[Import]] = {}
        for item in third_party(found):
            by_top.setdefault(item.top, []).append(item)
        for top, items in sorted(by_top.items()):
            dists = distributions(top)
            source = "optional" if top in OPTIONAL else source_of(dists, machine, wheels) or "MISSING"
            lazy = "lazy only" if all(item.lazy for item in items) else "module level"
            print(f"{top:20} {'/'.join(dists):28} {source:8} {lazy:12} {items[0].where()}")
        print(f"ComfyUI modules: {', '.join(sorted({i.module for i in found if i.top == COMFY}))}")
        return 0
    found_problems = problems(found, machine, wheels)
    for problem in found_problems:
        print(f"[gpu imports] {problem}")
    if not found_problems:
        print(f"[gpu imports] every import of {len(checked_files())} files is on the H200 machine or among the wheels")
    return 1 if found_problems else 0


if __name__ == "__main__":
    sys.exit(main())
