"""Nothing outside `tests/` imports from it: the pack, the core, the videos API, the workflow graphs, the scripts and
the benches run from a checkout without the tests, and a helper the tests share with a bench or a script lives with
the bench or the script (`bench/`, `scripts/`), where the tests import it from.

Every form counts, in every `.py` file outside `tests/`, wherever in the file it stands:

- `import tests...`, `from tests... import`, and a relative import that reaches the repository's `tests/` (the pack
  is a package inside ComfyUI, so `from ..tests import x` in `nodes/` would);
- a bare import of a module or folder of `tests/` (`from vace_tasks import ...`, `import support`), which works only
  with `tests/` or one of its folders on the path;
- `importlib.import_module` / `__import__` of such a name, and loading a file of `tests/` by its path
  (`spec_from_file_location`, `runpy.run_path`, `SourceFileLoader`);
- such an import statement in code held in a string for a child process (docstrings aside);
- putting `tests/` or a folder in it on the path: `sys.path` (insert, append, extend, assignment), `site.addsitedir`,
  or a child process's `PYTHONPATH`, also through a name assigned such a path, or a loop over such paths.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = "tests"
# Folders that hold no source of this repository: environments, ComfyUI trees, caches, node packages.
_NOT_SOURCE = {".git", ".venv", ".venvs", ".cache", ".gpu-wheels", "node_modules", "__pycache__"}
_PATH_EDITS = {"insert", "append", "extend"}
_LOADS_A_FILE = {"spec_from_file_location", "run_path", "SourceFileLoader"}
# An import statement in the source of a child process written out as a string (`python -c`, a script template).
_IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w.]+))", re.MULTILINE)


def source_files(root: Path) -> list[Path]:
    """Every `.py` file under `root` outside `root/tests` and the folders that hold no source of ours."""
    found = []
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        subfolders[:] = sorted(
            name for name in subfolders if name not in _NOT_SOURCE and not (here == root and name == TESTS)
        )
        found += [here / name for name in sorted(files) if name.endswith(".py")]
    return found


def names_in_tests(root: Path) -> set[str]:
    """What a bare import would find with `tests/` or a folder of it on the path: its modules and folders."""
    names = set()
    for _folder, subfolders, files in os.walk(root / TESTS):
        # Not below what is not source either (tests/browser/node_modules holds npm's `types`, `server`, ...).
        subfolders[:] = [name for name in subfolders if name not in _NOT_SOURCE]
        names |= set(subfolders) | {Path(name).stem for name in files if name.endswith(".py")}
    return names


def _is_sys_path(node: ast.AST) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


class _Finder:
    """The imports from `tests/` of one file (see the module docstring), as "line: what" strings."""

    def __init__(self, root: Path, path: Path, names: set[str]) -> None:
        self.path = path
        self.names = names
        parts = path.relative_to(root).with_suffix("").parts
        self.package = list(parts[:-1])
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        # Every value a name is given anywhere in the file: assignments, and the items a `for` loop runs over.
        self.values: dict[str, list[ast.AST]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.values.setdefault(name.id, []).append(node.value)
            elif isinstance(node, ast.For | ast.comprehension):
                for name in ast.walk(node.target):
                    if isinstance(name, ast.Name):
                        self.values.setdefault(name.id, []).append(node.iter)

    def _module_is_ours_in_tests(self, module: str) -> bool:
        top = module.split(".")[0]
        return top == TESTS or top in self.names

    def _absolute(self, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        if node.level - 1 > len(self.package):
            return None  # above the repository: another pack's, not ours
        base = self.package[: len(self.package) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def _is_tests_path(self, node: ast.AST, seen: frozenset[str] = frozenset()) -> bool:
        """Whether the expression builds a path in `tests/`: a string with `tests` as a part, or a name given one."""
        for item in ast.walk(node):
            if isinstance(item, ast.Constant) and isinstance(item.value, str):
                if TESTS in item.value.replace(os.sep, "/").split("/"):
                    return True
            elif isinstance(item, ast.Name) and item.id not in seen:
                if any(self._is_tests_path(value, seen | {item.id}) for value in self.values.get(item.id, ())):
                    return True
        return False

    def _docstrings(self) -> set[int]:
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        return {
            id(node.body[0].value)
            for node in ast.walk(self.tree)
            if isinstance(node, documented)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }

    def problems(self) -> list[str]:
        found = []
        docstrings = self._docstrings()
        for node in ast.walk(self.tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [
                    f"{line}: {match.group(0).strip()} (in a string of code)"
                    for match in _IMPORT_LINE.finditer(node.value)
                    if self._module_is_ours_in_tests(match.group(1) or match.group(2))
                ]
            elif isinstance(node, ast.Import):
                found += [f"{line}: import {a.name}" for a in node.names if self._module_is_ours_in_tests(a.name)]
            elif isinstance(node, ast.ImportFrom):
                module = self._absolute(node)
                if module is not None and (
                    self._module_is_ours_in_tests(module) or (not module and any(a.name == TESTS for a in node.names))
                ):
                    found.append(f"{line}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, ast.Call):
                called = _called(node)
                first = node.args[0] if node.args else None
                if (
                    called in ("import_module", "__import__")
                    and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and self._module_is_ours_in_tests(first.value)
                ):
                    found.append(f"{line}: {called}({first.value!r})")
                elif called in _LOADS_A_FILE and any(self._is_tests_path(arg) for arg in node.args):
                    found.append(f"{line}: {called} of a file in tests/")
                elif ((called in _PATH_EDITS and _is_sys_path(node.func.value)) or called == "addsitedir") and any(
                    self._is_tests_path(arg) for arg in node.args
                ):
                    found.append(f"{line}: puts tests/ on the path ({called})")
                found += [
                    f"{line}: puts tests/ on a child's PYTHONPATH"
                    for keyword in node.keywords
                    if keyword.arg == "PYTHONPATH" and self._is_tests_path(keyword.value)
                ]
            elif isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(_is_sys_path(target) for target in targets) and self._is_tests_path(node.value):
                    found.append(f"{line}: puts tests/ on the path (sys.path assignment)")
            elif isinstance(node, ast.Dict):
                found += [
                    f"{line}: puts tests/ on a child's PYTHONPATH"
                    for key, value in zip(node.keys, node.values, strict=True)
                    if isinstance(key, ast.Constant) and key.value == "PYTHONPATH" and self._is_tests_path(value)
                ]
        return sorted(set(found), key=lambda text: int(text.split(":")[0]))


def imports_from_tests(root: Path) -> list[str]:
    """Every import from `root/tests` by a file outside it, as "file:line: what"."""
    names = names_in_tests(root)
    return [
        f"{path.relative_to(root)}:{problem}"
        for path in source_files(root)
        for problem in _Finder(root, path, names).problems()
    ]


def test_nothing_outside_tests_imports_from_tests():
    problems = imports_from_tests(REPO)
    assert not problems, "move what these need out of tests/ (into the bench or script, or the product):\n" + "\n".join(
        problems
    )


def test_the_walk_reads_the_pack_scripts_and_benches_but_not_the_tests():
    files = {path.relative_to(REPO).as_posix() for path in source_files(REPO)}
    assert {"__init__.py", "scripts/demo.py", "bench/bench_windows.py", "workflow_graphs/build.py"} <= files
    assert not [name for name in files if name.startswith(f"{TESTS}/")]
    assert {"support", "vace_tasks", "conftest"} <= names_in_tests(REPO)


@pytest.mark.parametrize(
    ("relative", "source", "expected"),
    [
        ("bench/b.py", "from tests.support.vace_tasks import WIDTH\n", "1: from tests.support.vace_tasks import"),
        ("bench/b.py", "def f():\n    import tests.support.rss_like\n", "2: import tests.support.rss_like"),
        ("bench/b.py", "from tests import support\n", "1: from tests import"),
        ("scripts/s.py", "from vace_tasks import WIDTH\n", "1: from vace_tasks import"),
        ("scripts/s.py", "import support.vace_tasks\n", "1: import support.vace_tasks"),
        ("nodes/n.py", "from ..tests.support import vace_tasks\n", "1: from ..tests.support import"),
        ("__init__.py", "from .tests import support\n", "1: from .tests import"),
        ("bench/b.py", "import importlib\nimportlib.import_module('tests.support.x')\n", "2: import_module("),
        (
            "scripts/s.py",
            "import sys\nfrom pathlib import Path\nREPO = Path(__file__).parents[1]\n"
            "sys.path[:0] = [str(REPO / 'tests'), str(REPO)]\n",
            "4: puts tests/ on the path (sys.path assignment)",
        ),
        (
            "scripts/s.py",
            "import sys\nROOT = 'x'\nHELPERS = f'{ROOT}/tests/support'\n"
            "for p in (ROOT, HELPERS):\n    sys.path.insert(0, p)\n",
            "5: puts tests/ on the path (insert)",
        ),
        ("bench/b.py", "import site\nsite.addsitedir('tests')\n", "2: puts tests/ on the path (addsitedir)"),
        (
            "bench/b.py",
            'CHILD = """\nimport sys\nsys.path.insert(0, {repo!r})\nfrom tests.support.vace_tasks import WIDTH\n"""\n',
            "1: from tests.support.vace_tasks import (in a string of code)",
        ),
        (
            "bench/b.py",
            "import os\nenv = {**os.environ, 'PYTHONPATH': os.path.join('repo', 'tests')}\n",
            "2: puts tests/ on a child's PYTHONPATH",
        ),
        (
            "bench/b.py",
            "import importlib.util\nspec = importlib.util.spec_from_file_location('m', 'tests/test_x.py')\n",
            "2: spec_from_file_location of a file in tests/",
        ),
    ],
)
def test_the_check_finds_each_form(tmp_path, relative, source, expected):
    (tmp_path / TESTS / "support").mkdir(parents=True)
    (tmp_path / TESTS / "support" / "vace_tasks.py").write_text("WIDTH = 64\n")
    (tmp_path / TESTS / "conftest.py").write_text("from tests.support.vace_tasks import WIDTH\n")  # inside: fine
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    (tmp_path / "bench").mkdir(exist_ok=True)
    (tmp_path / "bench" / "fine.py").write_text(
        "import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).parents[1]))\n"
        "from bench.rss import read_status\nfrom . import tests_of_mine\n"
    )
    problems = imports_from_tests(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(f"{relative}:") and expected in problems[0], problems
