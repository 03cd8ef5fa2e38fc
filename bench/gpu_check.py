"""The Python half of bench/gpu_wheels.sh and bench/gpu_check.sh: the offline wheel set, the import check, the table.

    python3 bench/gpu_check.py wheels DEST [--has FREEZE]   # networked machine: what the GPU machine lacks
    python3 bench/gpu_check.py installable WHEELS            # GPU machine: the wheels this Python is to install
    python3 bench/gpu_check.py imports TEST_FILE...          # GPU machine: every module the GPU checks import
    python3 bench/gpu_check.py table WORK [--out FILE]       # GPU machine: the summary of one gpu_check.sh run

`wheels` runs under any Python 3.10+ with pip (no other package: `packaging` is pip's vendored copy where it is
not installed); the other two run under the GPU machine's python3.
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # what the device tool carries, the repo included
# The GPU machine's Python, for environment markers and wheel tags.
TARGET_PYTHON = "3.12"
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.3",
    "implementation_name": "cpython",
    "implementation_version": f"{TARGET_PYTHON}.3",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_release": "",
    "platform_version": "",
    "extra": "",
}
# Binary wheels only where no pure-Python one exists; glibc 2.28 or older covers most clusters' systems.
BINARY_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
# What the GPU machine's python3 is taken to have when no `pip freeze` of it is given (the machine):
# these and whatever pip resolves them to need.
MACHINE_HAS = (
    "torch==2.11.0",
    "transformers==5.17.*",
    "accelerate",
    "safetensors",
    "einops",
    "sentencepiece",
    "peft",
    "numpy",
    "pillow",
    "imageio",
)
# The gpu-marked tests run under pytest; pyproject's `timeout` option is pytest-timeout's.
TEST_TOOLS = ("pytest", "pytest-timeout")
# The fast-path bench's other side: SageAttention 1.x (what ComfyUI's --use-sage-attention runs; diffusers refuses
# it, so our `auto` does not pick it) and what ComfyUI's `comfy` package (copied by gpu_wheels.sh) imports at start.
FAST_PATH_TOOLS = ("sageattention==1.0.6", "comfy-aimdo==0.4.13")
# The benches gpu_check.sh runs, whose imports are checked with the library's and the tests'.
GPU_BENCHES = (
    "bench_offload_gpu.py",
    "bench_single_file_gpu.py",
    "bench_parallel_gpu.py",
    "bench_vae_tiling.py",
    "bench_fast_path_gpu.py",
)
# Imported by no import statement of ours: diffusers' Wan pipelines clean prompts with ftfy when it is installed
# (and fail without it), pytest loads pytest-timeout as a plugin, the parallel bench runs torch.distributed.run.
EXTRA_MODULES = ("ftfy", "pytest_timeout", "torch.distributed.run")
# Distributions whose version and origin (wheel folder or machine) the table names.
SHOWN = ("torch", "transformers", "diffusers", "cache-dit", "gguf", "ftfy", "protobuf", "accelerate", "pytest")

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare Python on the networked machine: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------------------------------
# wheels


def _requirements_file(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def _pins() -> dict[str, str]:
    pins = {}
    for line in _requirements_file(REPO / "scripts" / "sets" / "current.txt"):
        name, _, version = line.partition("==")
        pins[canonical(name)] = version.strip()
    return pins


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)


def _machine_from_freeze(path: Path) -> dict[str, str | None]:
    """`pip freeze` / `pip list --format=freeze` of the GPU machine: name -> version (None: a direct URL)."""
    has: dict[str, str | None] = {}
    for line in _requirements_file(path):
        if " @ " in line:
            has[canonical(line.split(" @ ", 1)[0])] = None
        elif "==" in line:
            name, _, version = line.partition("==")
            has[canonical(name)] = version.strip()
    return has


def _machine_resolved() -> dict[str, str | None]:
    """What pip installs for MACHINE_HAS on CPython 3.12 x86_64 (metadata only; nothing is installed)."""
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64"]
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        done = _pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--only-binary=:all:",
            "--python-version",
            TARGET_PYTHON,
            "--implementation",
            "cp",
            *(f"--platform={p}" for p in platforms),
            "--target",
            str(Path(folder) / "t"),
            *MACHINE_HAS,
        )
        if done.returncode != 0 or not report.exists():
            raise SystemExit(
                f"[gpu_wheels] could not resolve what the GPU machine has ({' '.join(MACHINE_HAS)}); pip said:\n"
                f"{done.stderr[-3000:]}\nGive `python3 -m pip freeze` of the GPU machine instead: "
                "bash bench/gpu_wheels.sh FREEZE.txt (pip 22.2 or newer is needed for this resolution)."
            )
        items = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in items}


class Wheel:
    def __init__(self, path: Path) -> None:
        self.path = path
        parts = path.name[: -len(".whl")].split("-")
        self.name, self.version, self.tag = canonical(parts[0]), parts[1], "-".join(parts[-3:])
        self.pure = path.name.endswith("-none-any.whl")

    def requires(self) -> list[str]:
        with zipfile.ZipFile(self.path) as archive:
            name = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            metadata = email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))
        return metadata.get_all("Requires-Dist") or []


def _download(requirement: str, dest: Path) -> Wheel:
    """One wheel for CPython 3.12 x86_64 into `dest`: a pure-Python one if the release has it, else a binary."""
    common = ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", TARGET_PYTHON]
    attempts = (
        ["--implementation", "py", "--abi", "none", "--platform", "any"],
        ["--implementation", "cp", *(f"--platform={p}" for p in BINARY_PLATFORMS)],
    )
    errors = []
    for attempt in attempts:
        with tempfile.TemporaryDirectory() as folder:
            done = _pip(*common, *attempt, "--dest", folder, requirement)
            files = list(Path(folder).glob("*.whl"))
            if done.returncode == 0 and len(files) == 1:
                target = dest / files[0].name
                shutil.move(str(files[0]), target)
                return Wheel(target)
            errors.append(done.stderr.strip().splitlines()[-1:] or ["(no message)"])
    raise SystemExit(f"[gpu_wheels] no wheel of {requirement} for CPython {TARGET_PYTHON} x86_64: {errors}")


def wheels(dest: Path, has_file: Path | None) -> int:
    has = _machine_from_freeze(has_file) if has_file else _machine_resolved()
    source = f"`pip freeze` in {has_file}" if has_file else f"pip's resolution of {' '.join(MACHINE_HAS)}"
    print(f"[gpu_wheels] the GPU machine is taken to have {len(has)} distributions ({source})")
    pins = _pins()
    partial = Path(tempfile.mkdtemp(prefix="gpu-wheels."))  # `dest` is replaced only once every wheel is in
    roots = _requirements_file(REPO / "requirements.txt") + list(TEST_TOOLS) + list(FAST_PATH_TOOLS)
    wanted_by = {**dict.fromkeys(TEST_TOOLS, "the gpu tests"), **dict.fromkeys(FAST_PATH_TOOLS, "the fast-path bench")}
    queue = [(Requirement(text), wanted_by.get(text, "requirements.txt")) for text in roots]
    specs: dict[str, list[tuple[SpecifierSet, str]]] = {}
    got: dict[str, Wheel] = {}
    while queue:
        requirement, wanted_by = queue.pop(0)
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET_MARKERS):
            continue
        name = canonical(requirement.name)
        specs.setdefault(name, []).append((requirement.specifier, wanted_by))
        combined = SpecifierSet(",".join(str(spec) for spec, _ in specs[name] if str(spec)))
        have = has.get(name, "absent")
        if name not in got and have != "absent" and (have is None or combined.contains(have, prereleases=True)):
            continue  # the machine's own copy does
        if name in got and combined.contains(got[name].version, prereleases=True):
            continue
        pin = pins.get(name)
        text = f"{name}=={pin}" if pin and combined.contains(pin, prereleases=True) else f"{name}{combined}"
        if name in got:  # one version of each: the newer requirement replaces it
            got[name].path.unlink()
        wheel = got[name] = _download(text, partial)
        print(f"[gpu_wheels] {wheel.path.name}  ({text}, for {wanted_by})", flush=True)
        queue += [(Requirement(dep), f"{wheel.name} {wheel.version}") for dep in wheel.requires()]
    lines = [f"# Wheels for bench/gpu_check.sh (CPython {TARGET_PYTHON} x86_64), made by bench/gpu_wheels.sh."]
    lines.append(f"# The GPU machine is taken to have: {source}.")
    for name, wheel in sorted(got.items()):
        wanted = sorted({by for _, by in specs[name]})
        shadows = f"; shadows the machine's {has[name]}" if name in has else ""
        kind = "pure Python" if wheel.pure else f"binary {wheel.tag}"
        lines.append(f"{wheel.path.name}  ({kind}; needed by {', '.join(wanted)}{shadows})")
    kept = sorted(name for name in specs if name not in got)
    lines.append(f"# Needed and taken from the machine: {', '.join(f'{n} {has[n]}' for n in kept)}")
    (partial / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(str(partial), dest)
    total = sum(path.stat().st_size for path in dest.iterdir())
    binaries = [w.path.name for w in got.values() if not w.pure]
    print("\n".join(lines[2:]))
    print(f"[gpu_wheels] {len(got)} wheels in {dest}: {total / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if binaries:
        print(f"[gpu_wheels] binary (CPython {TARGET_PYTHON} only): {', '.join(binaries)}")
    if total >= LIMIT_BYTES:
        print(
            f"[gpu_wheels] ERROR: {total / 2**20:.1f} MiB is not under the {LIMIT_BYTES / 2**20:.0f} MiB the "
            "device tool carries; give the machine's `pip freeze` (bench/gpu_wheels.sh FREEZE.txt) so fewer are "
            "downloaded",
            file=sys.stderr,
        )
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# installable


def installable(folder: Path) -> int:
    """Prints the wheels of `folder` this Python can install. One it cannot (a cp312 binary under another Python,
    as in bench/gpu_dry_run.sh) is left out when its distribution is installed already, else it is an error.
    The folder has no binary today: every wheel bench/gpu_wheels.sh chose is pure Python."""
    try:
        from packaging.tags import sys_tags
    except ImportError:
        from pip._vendor.packaging.tags import sys_tags
    supported = {str(tag) for tag in sys_tags()}
    missing = []
    for path in sorted(folder.glob("*.whl")):
        wheel = Wheel(path)
        interpreters, abis, platforms = (part.split(".") for part in wheel.tag.split("-"))
        if {f"{i}-{a}-{p}" for i in interpreters for a in abis for p in platforms} & supported:
            print(path)
            continue
        try:
            version = importlib.metadata.version(wheel.name)
            print(f"[gpu_check] {path.name} is not for this Python: using the installed {version}", file=sys.stderr)
        except importlib.metadata.PackageNotFoundError:
            missing.append(path.name)
    if missing:
        print(f"[gpu_check] ERROR: not for this Python, and not installed: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# imports


def _imports_in(path: Path):
    """(module, name or None) of every absolute import in the file, lazy ones inside functions included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            for alias in node.names:
                yield node.module, None if alias.name == "*" else alias.name


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports(test_files: list[str]) -> int:
    """Imports every module the library, the given test files (and the test helpers they import) and the GPU
    benches import, wherever the import statement stands, so nothing is found missing mid-run."""
    sys.path.insert(0, str(REPO))
    files = sorted((REPO / "wanvace_core").rglob("*.py")) + [REPO / "bench" / name for name in GPU_BENCHES]
    files += [REPO / "tests" / "conftest.py"] + [Path(name).resolve() for name in test_files]
    wanted: dict[tuple[str, str | None], Path] = {(module, None): Path(__file__) for module in EXTRA_MODULES}
    seen: set[Path] = set()
    while files:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        wanted.setdefault((_module_of(path), None), path)
        for module, name in _imports_in(path):
            wanted.setdefault((module, name), path)
            helper = REPO / Path(*module.split(".")).with_suffix(".py")
            if module.startswith("tests.") and helper.exists():
                files.append(helper)
    failures = []
    for (module, name), path in sorted(wanted.items(), key=lambda item: (item[0][0], item[0][1] or "")):
        try:
            imported = importlib.import_module(module)
            if name is not None and not hasattr(imported, name):
                importlib.import_module(f"{module}.{name}")
        except Exception as error:  # every failure is reported, with the file that imports it
            target = f"{module}.{name}" if name else module
            failures.append(f"{target} ({path.relative_to(REPO)}): {type(error).__name__}: {error}")
    third_party = {module.split(".")[0] for module, _ in wanted} - {"wanvace_core", "tests", "bench"}
    print(
        f"[imports] {len(wanted)} imports from {len(seen)} files; third-party top-level modules: "
        f"{', '.join(sorted(third_party - set(sys.stdlib_module_names)))}"
    )
    site = os.environ.get("WANVACE_GPU_SITE")
    shown = []
    for dist in SHOWN:
        try:
            found = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            shown.append(f"{dist} absent")
            continue
        origin = "wheels" if site and str(found.locate_file("")).startswith(site) else "machine"
        shown.append(f"{dist} {found.version} ({origin})")
    print(f"[imports] {', '.join(shown)}")
    if os.environ.get("WANVACE_GPU_WORK"):
        Path(os.environ["WANVACE_GPU_WORK"], "versions.txt").write_text(", ".join(shown) + "\n")
    if failures:
        print(f"[imports] {len(failures)} imports FAILED:\n  " + "\n  ".join(failures))
        print(
            "[imports] Remedy: on a networked machine run `bash bench/gpu_wheels.sh` (with the GPU machine's "
            "`python3 -m pip freeze` as its argument if it has other versions) and copy .gpu-wheels/ here."
        )
        return 1
    print("[imports] all imported")
    return 0


# --------------------------------------------------------------------------------------------------
# table


def _tests_line(junit: Path) -> str:
    if not junit.exists():
        return "tests (gpu-marked): no result (pytest did not finish; see the log)"
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag, outcome)
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failed.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
    line = "tests (gpu-marked): " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
    if failed:
        line += "\n  failed: " + ", ".join(failed)
    return line


def _row_lines(report: dict) -> list[str]:
    unit = report.get("time_unit", "s/step")
    partial = "" if report["state"] == "ok" else f"  [step {report['state']}: the rows it finished]"
    lines = [f"  {report['bench']} ({report['device']}): {report['config']}{partial}"]
    for row in report["rows"]:
        peak = f"{row['peak_gib']:7.1f} GiB" if row.get("peak_gib") is not None else f"{'-':>11}"
        ratios = "  ".join(f"{label} {value:.2f}" for label, value in row.get("ratios", {}).items())
        note = "; ".join(text for text in (ratios, row.get("note", "")) if text)
        lines.append(f"    {row['row']:32} {row['seconds']:8.2f} {unit:8} {peak}  {note}".rstrip())
    return lines


def table(work: Path, out: Path | None) -> int:
    steps = (
        [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines()]
        if (work / "steps.tsv").exists()
        else []
    )
    header = (work / "device.txt").read_text().strip() if (work / "device.txt").exists() else "no CUDA device"
    lines = ["", "=" * 100, f"gpu_check summary: {header}"]
    if (work / "versions.txt").exists():
        lines.append((work / "versions.txt").read_text().strip())
    lines.append("steps (status, seconds / limit):")
    problems = []
    for name, _kind, state, seconds, limit, _json in steps:
        lines.append(f"  {name:44} {state:24} {seconds:>4} / {limit} s")
        if state != "ok":
            problems.append(f"{name}: {state}")
    if any(kind == "tests" for _name, kind, *_ in steps):
        lines.append(_tests_line(work / "junit.xml"))
    else:
        lines.append("tests (gpu-marked): not run")
    reports = {kind: [] for kind in ("gpu", "cpu")}
    for _name, kind, state, _seconds, _limit, json_name in steps:
        path = work / json_name if json_name != "-" else None
        if path and path.exists() and kind in reports:
            reports[kind].append({**json.loads(path.read_text()), "state": state})
    # The CPU part's rows check the logic only (tiny configs; their times mean nothing): shown when no GPU row ran.
    shown = reports["gpu"] or reports["cpu"]
    if shown:
        what = "GPU" if reports["gpu"] else "CPU part (tiny configs: the logic; times mean nothing)"
        lines.append(f"bench rows, {what}; ratios measured side by side in this run:")
        lines.append(f"    {'row':32} {'time':>8} {'':8} {'peak VRAM':>11}  ratios; notes")
        for report in shown:
            lines += _row_lines(report)
    lines.append("RESULT: " + ("FAILED: " + "; ".join(problems) if problems else "every step ok"))
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.write_text(text.lstrip("\n") + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("wheels", help="download what the GPU machine lacks (networked machine)")
    p.add_argument("dest", type=Path)
    p.add_argument("--has", type=Path, help="`python3 -m pip freeze` of the GPU machine")
    p = commands.add_parser("installable", help="the wheels of a folder this Python can install")
    p.add_argument("folder", type=Path)
    p = commands.add_parser("imports", help="import every module the GPU checks import")
    p.add_argument("test_files", nargs="*")
    p = commands.add_parser("table", help="the summary table of a gpu_check.sh run")
    p.add_argument("work", type=Path)
    p.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "wheels":
        return wheels(args.dest.resolve(), args.has)
    if args.command == "installable":
        return installable(args.folder)
    if args.command == "imports":
        return imports(args.test_files)
    return table(args.work, args.out)


if __name__ == "__main__":
    sys.exit(main())
