"""The Python half of bench/gpu_wheels.sh and bench/gpu_check.sh: the offline wheel set, the import check, the table.

    python3 bench/gpu_check.py wheels DEST --lock [--has FREEZE]  # networked: resolve, write the lock, download
    python3 bench/gpu_check.py wheels DEST                        # networked: download what the lock names
    python3 bench/gpu_check.py installable WHEELS                 # GPU machine: the wheels this Python installs
    python3 bench/gpu_check.py imports                            # GPU machine: import all the GPU checks import
    python3 bench/gpu_check.py table WORK [--out DIR] [--quiet]   # the summary of one gpu_check.sh run
    python3 bench/gpu_check.py leftovers MARKER                   # kill what a finished step left running

The lock (bench/gpu_wheels.lock.json, committed) is the wheel set: `--lock` resolves it from requirements.txt with
scripts/sets/current.txt's pins, the test tools and the fast path's ComfyUI row (SageAttention 1.0.6 and what
ComfyUI 0.33's `comfy` package imports that the machine lacks: comfy-kitchen, comfy-aimdo, at the versions its
requirements.txt pins), following every Requires-Dist (markers read for CPython 3.12 on Linux x86_64) and skipping
what bench/h200_packages.txt (the H200 machine's python3, from the device library's KINDS.md) already has at a
fitting version. Each entry keeps its Requires-Dist, so tests/test_gpu_imports.py checks the lock offline.

`wheels` and `--lock` run under any Python 3.10+ with pip (no other package: `packaging` is pip's vendored copy
where it is not installed); the others run under the GPU machine's python3.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import gpu_imports  # noqa: E402

LIMIT_BYTES = 64 * 2**20  # what the device tool carries, the repository included
WHEELS_LIMIT_BYTES = 48 * 2**20  # the wheels' share, leaving room for the repository and ComfyUI's files
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
# The gpu-marked tests run under pytest; `--timeout` is pytest-timeout's (both are on the H200 machine).
TEST_TOOLS = ("pytest", "pytest-timeout")
# The fast-path bench's ComfyUI row: SageAttention 1.x (what ComfyUI's --use-sage-attention runs; diffusers 0.42
# wants >= 2.1.1, so our `auto` does not pick it) and what ComfyUI's `comfy` package imports at start that the
# machine lacks, at the versions the ComfyUI tree's requirements.txt pins (these when no tree is at hand: 0.33's,
# which the committed lock is for; a tree pinning others needs `gpu_wheels.sh --lock`, `wheels` says so).
COMFY_TOOLS = ("comfy-kitchen", "comfy-aimdo")
COMFY_TOOL_PINS = {"comfy-kitchen": "0.2.31", "comfy-aimdo": "0.4.13"}
SAGE = "sageattention==1.0.6"
# Distributions whose version and origin (wheel folder or machine) the table names.
SHOWN = (
    "torch",
    "transformers",
    "diffusers",
    "cache-dit",
    "gguf",
    "accelerate",
    "huggingface-hub",
    "numpy",
    "triton",
    "comfy-kitchen",
    "sageattention",
    "pytest",
)

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare Python on the networked machine: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet

canonical = gpu_imports.canonical


# --------------------------------------------------------------------------------------------------
# wheels


def _requirements_file(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def pins() -> dict[str, str]:
    """scripts/sets/current.txt: name -> the pinned version."""
    found = {}
    for line in _requirements_file(REPO / "scripts" / "sets" / "current.txt"):
        name, _, version = line.partition("==")
        found[canonical(name)] = version.strip()
    return found


def comfy_tree() -> Path:
    return Path(os.environ.get("WANVACE_COMFY_DIR") or REPO / ".cache" / "comfyui-current")


def comfy_tool_pins(tree: Path | None = None) -> dict[str, str]:
    """The versions the ComfyUI tree's requirements.txt pins for COMFY_TOOLS (0.33's where it names none)."""
    found = dict(COMFY_TOOL_PINS)
    requirements = (tree or comfy_tree()) / "requirements.txt"
    if requirements.exists():
        for line in _requirements_file(requirements):
            name, _, version = line.partition("==")
            if canonical(name) in COMFY_TOOLS and version:
                found[canonical(name)] = version.strip()
    return found


def roots(tree: Path | None = None) -> list[tuple[str, str]]:
    """(requirement, why) of everything the GPU check needs beyond the standard library and our own code."""
    found = [(line, "requirements.txt") for line in _requirements_file(REPO / "requirements.txt")]
    found += [(name, "the gpu tests") for name in TEST_TOOLS]
    found += [(SAGE, "the fast path's ComfyUI row (its --use-sage-attention)")]
    found += [(f"{name}=={version}", "ComfyUI's comfy package") for name, version in comfy_tool_pins(tree).items()]
    return found


def stale_roots(lock: dict, tree: Path | None = None) -> list[str]:
    """The inputs `roots(tree)` names that the lock was not resolved from: empty when the lock fits them."""
    locked = {root["requirement"] for root in lock["roots"]}
    return [text for text, _why in roots(tree) if text not in locked]


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)


def machine_from_freeze(path: Path) -> dict[str, str | None]:
    """`pip freeze` / `pip list --format=freeze` of the GPU machine: name -> version (None: a direct URL)."""
    has: dict[str, str | None] = {}
    for line in _requirements_file(path):
        if " @ " in line:
            has[canonical(line.split(" @ ", 1)[0])] = None
        elif "==" in line:
            name, _, version = line.partition("==")
            has[canonical(name)] = version.strip()
    return has


def satisfied_by_machine(requirement: Requirement, has: dict[str, str | None]) -> bool:
    """The machine has it at a fitting version (a version the list does not record is taken to fit)."""
    version = has.get(canonical(requirement.name), "absent")
    return version != "absent" and (version is None or requirement.specifier.contains(version, prereleases=True))


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


def target_requirements(requires: list[str]) -> list[str]:
    """The Requires-Dist lines that apply on the GPU machine (CPython 3.12, Linux x86_64, no extras)."""
    return [
        text
        for text in requires
        if Requirement(text).marker is None or Requirement(text).marker.evaluate(TARGET_MARKERS)
    ]


def resolve(dest: Path, has: dict[str, str | None], source: str) -> dict:
    """Downloads into `dest` what the machine lacks for `roots()`, following Requires-Dist; returns the lock."""
    pinned = pins()
    queue = [(Requirement(text), why) for text, why in roots()]
    specs: dict[str, list[tuple[SpecifierSet, str]]] = {}
    got: dict[str, Wheel] = {}
    while queue:
        requirement, wanted_by = queue.pop(0)
        if requirement.marker is not None and not requirement.marker.evaluate(TARGET_MARKERS):
            continue
        name = canonical(requirement.name)
        specs.setdefault(name, []).append((requirement.specifier, wanted_by))
        combined = SpecifierSet(",".join(str(spec) for spec, _ in specs[name] if str(spec)))
        if name not in got and satisfied_by_machine(Requirement(f"{name}{combined}"), has):
            continue  # the machine's own copy does
        if name in got and combined.contains(got[name].version, prereleases=True):
            continue
        pin = pinned.get(name)
        text = f"{name}=={pin}" if pin and combined.contains(pin, prereleases=True) else f"{name}{combined}"
        if name in got:  # one version of each: the newer requirement replaces it
            got[name].path.unlink()
        wheel = got[name] = _download(text, dest)
        print(f"[gpu_wheels] {wheel.path.name}  ({text}, for {wanted_by})", flush=True)
        queue += [(Requirement(dep), f"{wheel.name} {wheel.version}") for dep in wheel.requires()]
    entries = []
    for name, wheel in sorted(got.items()):
        entries.append(
            {
                "name": name,
                "version": wheel.version,
                "file": wheel.path.name,
                "bytes": wheel.path.stat().st_size,
                "pure": wheel.pure,
                "needed_by": sorted({by for _, by in specs[name]}),
                "requires": target_requirements(wheel.requires()),
            }
        )
    kept = {name: has[name] for name in sorted(specs) if name not in got}
    return {
        "about": "The wheels bench/gpu_wheels.sh downloads into .gpu-wheels/ for bench/gpu_check.sh on the GPU "
        "machine (CPython 3.12, Linux x86_64, no network). Made by `bash bench/gpu_wheels.sh --lock`; "
        "tests/test_gpu_imports.py checks it offline.",
        "machine": source,
        "roots": [{"requirement": text, "why": why} for text, why in roots()],
        "wheels": entries,
        "taken_from_machine": kept,
        "bytes": sum(entry["bytes"] for entry in entries),
    }


def download_locked(lock: dict, dest: Path) -> None:
    """Downloads exactly the lock's wheels into `dest` (each must come out as the file the lock names)."""
    for entry in lock["wheels"]:
        wheel = _download(f"{entry['name']}=={entry['version']}", dest)
        if wheel.path.name != entry["file"]:
            raise SystemExit(
                f"[gpu_wheels] {entry['name']}=={entry['version']} came as {wheel.path.name}, the lock names "
                f"{entry['file']}: run `bash bench/gpu_wheels.sh --lock` to resolve again"
            )
        print(f"[gpu_wheels] {wheel.path.name}", flush=True)


def wheels(dest: Path, lock_again: bool, has_file: Path | None) -> int:
    if not lock_again:
        if not gpu_imports.WHEEL_LOCK.exists():
            print("[gpu_wheels] ERROR: no bench/gpu_wheels.lock.json; run `bash bench/gpu_wheels.sh --lock`")
            return 1
        lock = json.loads(gpu_imports.WHEEL_LOCK.read_text())
        # The wheels must fit the comfy package copied beside them: a newer ComfyUI pins other comfy-kitchen/-aimdo.
        changed = stale_roots(lock)
        if changed:
            print(
                f"[gpu_wheels] ERROR: bench/gpu_wheels.lock.json was resolved without {', '.join(changed)} (from "
                f"requirements.txt, scripts/sets/current.txt or the ComfyUI at {comfy_tree()}): run "
                "`bash bench/gpu_wheels.sh --lock` to resolve it for these"
            )
            return 1
    partial = Path(tempfile.mkdtemp(prefix="gpu-wheels."))  # `dest` is replaced only once every wheel is in
    if lock_again:
        has = machine_from_freeze(has_file) if has_file else gpu_imports.machine_packages()
        source = f"`pip freeze` in {has_file}" if has_file else "bench/h200_packages.txt"
        print(f"[gpu_wheels] resolving: the GPU machine is taken to have {len(has)} distributions ({source})")
        lock = resolve(partial, has, source)
        gpu_imports.WHEEL_LOCK.write_text(json.dumps(lock, indent=1) + "\n")
        print(f"[gpu_wheels] wrote {gpu_imports.WHEEL_LOCK.relative_to(REPO)}: commit it")
    else:
        download_locked(lock, partial)
    lines = [f"# Wheels for bench/gpu_check.sh (CPython {TARGET_PYTHON} x86_64): bench/gpu_wheels.lock.json"]
    lines += [
        f"{entry['file']}  ({'pure Python' if entry['pure'] else 'binary'}; needed by {', '.join(entry['needed_by'])})"
        for entry in lock["wheels"]
    ]
    kept = lock["taken_from_machine"]
    kept_text = ", ".join(f"{name} {version or '(version not recorded)'}" for name, version in kept.items())
    lines.append(f"# Needed and taken from the machine: {kept_text}")
    (partial / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(str(partial), dest)
    total = sum(path.stat().st_size for path in dest.glob("*.whl"))
    print("\n".join(lines[1:]))
    print(f"[gpu_wheels] {len(lock['wheels'])} wheels in {dest}: {total / 2**20:.1f} MiB")
    binaries = [entry["file"] for entry in lock["wheels"] if not entry["pure"]]
    if binaries:
        print(f"[gpu_wheels] binary (CPython {TARGET_PYTHON} only): {', '.join(binaries)}")
    if total >= WHEELS_LIMIT_BYTES:
        print(
            f"[gpu_wheels] ERROR: {total / 2**20:.1f} MiB of wheels leaves too little of the {LIMIT_BYTES / 2**20:.0f} "
            "MiB the device tool carries (the repository and ComfyUI's files travel too)",
            file=sys.stderr,
        )
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# installable


def installable(folder: Path) -> int:
    """Prints the wheels of `folder` this Python can install. One it cannot (a cp312 binary under another Python)
    is left out when its distribution is installed already, else it is an error; so is a wheel of the lock that
    the folder lacks (made from another lock: run bench/gpu_wheels.sh again)."""
    try:
        from packaging.tags import sys_tags
    except ImportError:
        from pip._vendor.packaging.tags import sys_tags
    supported = {str(tag) for tag in sys_tags()}
    missing, present = [], set()
    for path in sorted(folder.glob("*.whl")):
        wheel = Wheel(path)
        present.add(path.name)
        interpreters, abis, platforms = (part.split(".") for part in wheel.tag.split("-"))
        if {f"{i}-{a}-{p}" for i in interpreters for a in abis for p in platforms} & supported:
            print(path)
            continue
        try:
            version = importlib.metadata.version(wheel.name)
            print(f"[gpu_check] {path.name} is not for this Python: using the installed {version}", file=sys.stderr)
        except importlib.metadata.PackageNotFoundError:
            missing.append(path.name)
    locked = {entry["file"] for entry in gpu_imports.locked_wheels().values()}
    if locked - present:
        missing += [
            f"{name} (named by bench/gpu_wheels.lock.json; run bench/gpu_wheels.sh)" for name in locked - present
        ]
    if missing:
        print(f"[gpu_check] ERROR: not installable here: {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# imports


def _import(name: str) -> None:
    """Imports module `name`, or `name`'s last part as an attribute of its parent (`from x import y`)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        parent, _, attribute = name.rpartition(".")
        if not parent or error.name != name:
            raise
        if not hasattr(importlib.import_module(parent), attribute):
            raise


def imports() -> int:
    """Imports every module the library, the gpu-marked tests (with their helpers and conftest) and the GPU benches
    import, wherever the import statement stands, and ComfyUI's modules for the fast path's ComfyUI row from the
    tree at $WANVACE_COMFY_DIR; so nothing is found missing mid-run. The `OPTIONAL` modules (gpu_imports.py) may be
    absent. Every failure is listed, with the file that imports it."""
    import torch

    found = gpu_imports.all_imports()
    wanted: dict[str, str] = {}
    for item in found:
        if item.top not in gpu_imports.OPTIONAL and item.top != gpu_imports.COMFY:
            wanted.setdefault(item.module, item.where())
    failures = []
    for name, where in sorted(wanted.items()):
        try:
            _import(name)
        except Exception as error:  # every failure is reported, with the file that imports it
            failures.append(f"{name} ({where}): {type(error).__name__}: {error}")
    tree = os.environ.get("WANVACE_COMFY_DIR")
    comfy = []
    if not tree or not (Path(tree) / "comfy").is_dir():
        failures.append(
            f"ComfyUI's comfy package: no tree at WANVACE_COMFY_DIR={tree!r} (bench/gpu_wheels.sh copies one into "
            ".gpu-wheels/comfyui); the fast path's ComfyUI row cannot run"
        )
    else:
        sys.path.append(tree)
        comfy = gpu_imports.comfy_modules(found, Path(tree))
        try:
            from comfy.cli_args import args as comfy_args

            comfy_args.cpu = not torch.cuda.is_available()
            for name in comfy:
                _import(name)
        except Exception as error:  # ComfyUI's own import chain (comfy_kitchen, comfy_aimdo, ...)
            failures.append(f"ComfyUI's {name if comfy else 'comfy'} from {tree}: {type(error).__name__}: {error}")
    optional = []
    for top, why in gpu_imports.OPTIONAL.items():
        try:
            importlib.import_module(top)
            optional.append(f"{top} present")
        except ImportError:
            optional.append(f"{top} absent ({why})")
    tops = {name.split(".")[0] for name in wanted} - set(sys.stdlib_module_names) - set(gpu_imports.OURS)
    print(
        f"[imports] {len(wanted)} imports from {len(gpu_imports.checked_files())} files and {len(comfy)} ComfyUI "
        f"modules; third-party: {', '.join(sorted(tops))}; optional: {'; '.join(optional)}"
    )
    site = os.environ.get("WANVACE_GPU_SITE")
    shown = []
    for dist in SHOWN:
        try:
            found_dist = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            shown.append(f"{dist} absent")
            continue
        origin = "wheels" if site and str(found_dist.locate_file("")).startswith(site) else "machine"
        shown.append(f"{dist} {found_dist.version} ({origin})")
    print(f"[imports] {', '.join(shown)}")
    if os.environ.get("WANVACE_GPU_WORK"):
        Path(os.environ["WANVACE_GPU_WORK"], "versions.txt").write_text(", ".join(shown) + "\n")
    if failures:
        print(f"[imports] {len(failures)} imports FAILED:\n  " + "\n  ".join(failures))
        print(
            "[imports] Remedy: on a networked machine run `bash bench/gpu_wheels.sh` (`--lock` first if the "
            "GPU machine's packages differ from bench/h200_packages.txt) and bring .gpu-wheels/ along."
        )
        return 1
    print("[imports] all imported")
    return 0


# --------------------------------------------------------------------------------------------------
# leftovers


def leftovers(marker: str, kill: bool) -> int:
    """Processes whose environment carries WANVACE_GPU_STEP=`marker` (a step of gpu_check.sh and whatever it
    started, torchrun's ranks in their own sessions too): printed, and killed with `kill`. Returns how many."""
    needle = f"WANVACE_GPU_STEP={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(entry.name), command))
    for pid, command in found:
        print(f"[gpu_check] left behind by the step: pid {pid}: {command[:200]}")
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return len(found)


# --------------------------------------------------------------------------------------------------
# table


def _tests_line(junit: Path) -> tuple[str, bool]:
    """The tests' counts (and the failed ones' names), and whether any failed."""
    if not junit.exists():
        return "tests (gpu-marked): no result (pytest did not finish; see the log)", True
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
    return line, bool(failed)


def _time(seconds: float) -> str:
    return f"{seconds:8.2f} s " if seconds >= 1 else f"{seconds * 1e3:8.2f} ms"


def _row_lines(report: dict) -> list[str]:
    partial = "" if report["state"] == "ok" else f"  [step {report['state']}: the rows it finished]"
    unit = report.get("time_unit", "")
    lines = [f"  {report['bench']} ({report['device']}, time {unit}): {report['config']}{partial}"]
    for row in report["rows"]:
        if row.get("seconds") is None:
            what = f"FAILED: {row['failed']}" if row.get("failed") else row.get("note", "")
            lines.append(f"    {row['row']:56} {'-':>11}  {what}".rstrip())
            continue
        spread = f"±{row['spread'] / 2:4.0%}" if row.get("spread") is not None else "     "
        peak = f"{row['peak_gib']:6.1f} GiB" if row.get("peak_gib") is not None else f"{'':10}"
        ratios = "  ".join(f"{label} {value:.2f}" for label, value in row.get("ratios", {}).items())
        failed = f"FAILED: {row['failed']}" if row.get("failed") else ""
        note = "; ".join(text for text in (failed, ratios, row.get("note", "")) if text)
        lines.append(f"    {row['row']:56} {_time(row['seconds'])} {spread} {peak}  {note}".rstrip())
    return lines


def table(work: Path, out: Path | None, quiet: bool) -> int:
    """The summary of the run so far from WORK's steps.tsv and per-step JSON: printed (unless `quiet`) and written to
    OUT as gpu_check_table.txt and gpu_check.json (every step's JSON in one file). Returns 0."""
    steps = (
        [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines()]
        if (work / "steps.tsv").exists()
        else []
    )
    header = (work / "device.txt").read_text().strip() if (work / "device.txt").exists() else "device not probed"
    lines = ["", "=" * 110, f"gpu_check summary: {header}"]
    if (work / "versions.txt").exists():
        lines.append((work / "versions.txt").read_text().strip())
    lines.append("steps (status, seconds / limit; estimate):")
    problems = []
    reports = []
    for name, kind, state, seconds, limit, json_name, estimate in steps:
        lines.append(f"  {name:58} {state:22} {seconds:>4} / {limit} s; est. {estimate} s")
        if state != "ok" and not state.startswith("skipped"):
            problems.append(f"{name}: {state}")
        path = work / json_name if json_name != "-" else None
        if path and path.exists():
            reports.append({**json.loads(path.read_text()), "state": state, "step": name, "kind": kind})
    tests_run = any(kind == "tests" for _name, kind, *_ in steps)
    if tests_run:
        line, _failed = _tests_line((out if out is not None else work) / "junit.xml")
        lines.append(line)
    shown = [report for report in reports if report["kind"] == "gpu"] or reports
    if shown:
        what = (
            "GPU" if any(report["kind"] == "gpu" for report in reports) else "CPU part (the logic; times mean nothing)"
        )
        lines.append(
            f"bench rows, {what}: median ±half the spread, peak VRAM, ratios measured side by side in this run:"
        )
        for report in shown:
            lines += _row_lines(report)
            problems += [f"{report['step']}: {row['row']} failed" for row in report["rows"] if row.get("failed")]
    lines.append("RESULT: " + ("FAILED: " + "; ".join(problems) if problems else "every step ok"))
    text = "\n".join(lines)
    if not quiet:
        print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check_table.txt").write_text(text.lstrip("\n") + "\n")
        summary = {
            "device": header,
            "versions": (work / "versions.txt").read_text().strip() if (work / "versions.txt").exists() else None,
            "steps": [
                dict(zip(("name", "kind", "state", "seconds", "limit", "json", "estimate"), step, strict=True))
                for step in steps
            ],
            "reports": reports,
            "result": "ok" if not problems else problems,
        }
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("wheels", help="download the lock's wheels (networked machine)")
    p.add_argument("dest", type=Path)
    p.add_argument("--lock", action="store_true", help="resolve again and rewrite bench/gpu_wheels.lock.json")
    p.add_argument("--has", type=Path, help="with --lock: `python3 -m pip freeze` of the GPU machine")
    p = commands.add_parser("installable", help="the wheels of a folder this Python can install")
    p.add_argument("folder", type=Path)
    commands.add_parser("imports", help="import every module the GPU checks import")
    p = commands.add_parser("table", help="the summary table of a gpu_check.sh run")
    p.add_argument("work", type=Path)
    p.add_argument("--out", type=Path, help="write gpu_check_table.txt and gpu_check.json here")
    p.add_argument("--quiet", action="store_true", help="write the files only")
    p = commands.add_parser("leftovers", help="list (and kill) the processes a step left behind")
    p.add_argument("marker")
    p.add_argument("--kill", action="store_true")
    args = parser.parse_args()
    if args.command == "wheels":
        if args.has and not args.lock:
            parser.error("--has needs --lock (a machine with other packages needs another lock)")
        return wheels(args.dest.resolve(), args.lock, args.has)
    if args.command == "installable":
        return installable(args.folder)
    if args.command == "imports":
        return imports()
    if args.command == "leftovers":
        return 1 if leftovers(args.marker, args.kill) else 0
    return table(args.work, args.out, args.quiet)


if __name__ == "__main__":
    sys.exit(main())
