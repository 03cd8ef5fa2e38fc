"""Our nodes import ComfyUI's node API from the versioned module `comfy_api.v0_0_2`, never `comfy_api.latest`.

ComfyUI's documentation (docs.comfy.org, "V3 migration"): `comfy_api.latest` points at the numbered API still under
development and changes with releases; versioned modules are how the schema stays backwards compatible, the one
before `latest` counting as stable. Both ComfyUI versions we support (0.3.75, 0.33) ship `comfy_api.v0_0_2` with the
`io` and `ComfyExtension` our nodes use, and newer ComfyUI adds `v0_0_3` while keeping `v0_0_2` among its supported
versions. Today `v0_0_2` re-exports `latest`'s objects, so nothing differs at run time; when ComfyUI moves `latest`
on, nodes written against `v0_0_2` keep the API they were written for. A node file that imports `latest` (a new node
copied from an example, say) fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PINNED = "comfy_api.v0_0_2"


def _comfy_api_imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "comfy_api":
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names if alias.name.split(".")[0] == "comfy_api"]
    return modules


def test_nodes_import_the_versioned_comfy_api():
    files = [
        REPO / "__init__.py",
        *sorted((REPO / "nodes").rglob("*.py")),
        *sorted((REPO / "videos_api").rglob("*.py")),
    ]
    imports = {path.relative_to(REPO).as_posix(): _comfy_api_imports(path) for path in files}
    elsewhere = {path: modules for path, modules in imports.items() if any(module != PINNED for module in modules)}
    assert not elsewhere, f"import ComfyUI's node API (io, ComfyExtension) from {PINNED}: {elsewhere}"
    # The walk found the node files (a guard over no files would pass whatever they import).
    assert sum(1 for modules in imports.values() if modules) >= 10, imports
