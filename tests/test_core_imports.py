"""The core's imports run one way, have no cycle, and never reach ComfyUI.

Every import in `wanvace_core/` counts: at module level, inside functions (a lazy import can hide a cycle
only until the function runs), relative or absolute, and `importlib.import_module` of a literal name. The
layers, each importing only from itself and the layers after it:

    wanvace_core (the API the nodes use), wanvace_core.worker and wanvace_core.generate (the offline command)
    → generation → runtime → parallel → load → errors / validation / hooks
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "wanvace_core"

# Highest first; a module may import modules of its own layer (no cycle) or of a later one.
LAYERS = (
    ("wanvace_core", "wanvace_core.worker", "wanvace_core.generate"),
    ("wanvace_core.generation",),
    ("wanvace_core.runtime",),
    ("wanvace_core.parallel",),
    ("wanvace_core.load",),
    ("wanvace_core.errors", "wanvace_core.validation", "wanvace_core.hooks"),
)
# Top-level modules of a ComfyUI tree (its package and the modules of its root folder).
COMFYUI_MODULES = {
    "comfy",
    "comfy_api",
    "comfy_api_nodes",
    "comfy_config",
    "comfy_execution",
    "comfy_extras",
    "execution",
    "folder_paths",
    "latent_preview",
    "node_helpers",
    "nodes",
    "server",
}


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, wherever in the file it sits."""
    name = module_name(root, path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((node.lineno, target))
            # `from . import messages` imports a module, not a name
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def core_import_problems(root: Path) -> list[str]:
    """Imports of ComfyUI, imports against the layer order, and cycles among the modules under `root`."""
    modules = {module_name(root, path): path for path in sorted(root.rglob("*.py"))}
    problems, edges = [], {name: set() for name in modules}
    for name, path in modules.items():
        for line, target in imports_of(root, path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target.split(".")[0] in COMFYUI_MODULES:
                problems.append(f"{where} imports ComfyUI's {target}: the core must run without ComfyUI")
                continue
            if target not in modules or target == name:
                continue  # another library, or a name (not a module) of a core module
            edges[name].add(target)
            if name.startswith(target + "."):
                continue  # a package's own __init__, which Python runs first anyway
            if layer_of(target) < layer_of(name):
                problems.append(f"{where}: {name} imports {target}, a module of a layer above it")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (a parent package's __init__ excluded)."""
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in edges.items()}
    cycles, state, stack = [], {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_the_core_imports_one_way_without_cycles_or_comfyui():
    assert core_import_problems(CORE) == []


def test_every_core_module_sits_in_a_layer():
    unplaced = [module_name(CORE, path) for path in CORE.rglob("*.py") if layer_of(module_name(CORE, path)) is None]
    assert unplaced == []


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a lazy import inside a function closes a cycle between two load modules
            {"load/a.py": "from .b import x\n", "load/b.py": "def f():\n    from .a import y\n"},
            "import cycle: wanvace_core.load.a -> wanvace_core.load.b -> wanvace_core.load.a",
        ),
        (  # loading reaching up into the runtime (the cycle this layout removed started so)
            {"load/a.py": "def f():\n    from ..runtime.plan import apply_plan\n", "runtime/plan.py": ""},
            "wanvace_core.load.a imports wanvace_core.runtime.plan, a module of a layer above it",
        ),
        (
            {"runtime/plan.py": "def f():\n    import comfy.model_management\n"},
            "imports ComfyUI's comfy.model_management",
        ),
        (
            {"parallel/x.py": "import importlib\nimportlib.import_module('folder_paths')\n"},
            "imports ComfyUI's folder_paths",
        ),
        (  # `from . import name` where the name is a module of a higher layer
            {"load/a.py": "from .. import generation\n", "generation/__init__.py": ""},
            "wanvace_core.load.a imports wanvace_core.generation, a module of a layer above it",
        ),
    ],
)
def test_the_check_finds_each_kind_of_problem(tmp_path, files, expected):
    root = tmp_path / "wanvace_core"
    _write(root, {"__init__.py": "", "load/__init__.py": "", "runtime/__init__.py": "", **files})
    problems = core_import_problems(root)
    assert len(problems) == 1 and expected in problems[0], problems
