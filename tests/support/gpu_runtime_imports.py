"""What importing every module the GPU check runs really loads (bench/gpu_imports.py lists them from their source):
run as `python -m tests.support.gpu_runtime_imports [--comfy DIR]` by tests/test_gpu_imports.py, in a fresh
interpreter, and prints one JSON line. It lives with the tests because it imports the gpu-marked test modules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.gpu_imports import COMFY, OURS, REPO, all_imports, canonical, checked_files, comfy_modules, locked_wheels


def runtime(comfy_dir: str | None, modules: list[str]) -> dict:
    """Imports `modules` (ours), then ComfyUI's bench modules from `comfy_dir`, in this process, and records each
    import statement that runs (`builtins.__import__`), module-level chains included. Returns, per stage, the
    top-level modules that our code, ComfyUI's tree or a wheel's package imported successfully (what the machine's
    own packages import among themselves is the machine's business), with who imported them; and what failed."""
    import builtins
    import importlib
    import importlib.metadata

    import torch  # the machine's own; its dependencies are the machine's business

    wheel_tops = {
        top
        for top, dists in importlib.metadata.packages_distributions().items()
        if {canonical(dist) for dist in dists} & set(locked_wheels())
    }
    importers = {*OURS, COMFY, *wheel_tops}
    seen: dict[str, set[str]] = {}
    original_import = builtins.__import__

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = original_import(name, globals, locals, fromlist, level)
        importer = (globals or {}).get("__name__") or ""
        if level == 0 and importer.split(".")[0] in importers:
            seen.setdefault(name.split(".")[0], set()).add(importer)
        return module

    stages = {"ours": modules, "comfy": comfy_modules(all_imports(), Path(comfy_dir)) if comfy_dir else []}
    loaded, failed = {}, {}
    builtins.__import__ = recording_import
    try:
        for stage, names in stages.items():
            seen.clear()
            if stage == "comfy" and names:
                sys.path.append(comfy_dir)  # after ours: the tree's own `tests` package must not shadow ours
                from comfy.cli_args import args as comfy_args

                comfy_args.cpu = not torch.cuda.is_available()
            for name in names:
                try:
                    importlib.import_module(name)
                except Exception as error:  # every failure is reported with its module
                    failed[name] = f"{type(error).__name__}: {error}"
            loaded[stage] = {
                top: sorted(by)[:3]
                for top, by in sorted(seen.items())
                if top not in sys.stdlib_module_names and top not in (*OURS, COMFY) and top in sys.modules
            }
    finally:
        builtins.__import__ = original_import
    return {"loaded": loaded, "failed": failed}


def our_modules() -> list[str]:
    """The importable module names of the checked files (tests and benches as `tests.support.x`, `bench.x`)."""
    names = []
    for path in checked_files():
        relative = path.relative_to(REPO).with_suffix("")
        names.append(".".join(relative.parts).removesuffix(".__init__"))
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfy", help="a ComfyUI tree (the one bench/gpu_wheels.sh copies)")
    args = parser.parse_args()
    print(json.dumps(runtime(args.comfy, our_modules())))


if __name__ == "__main__":
    main()
