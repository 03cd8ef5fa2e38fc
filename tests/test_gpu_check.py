"""bench/gpu_check.sh's own machinery, on the CPU: a step leaves no process behind (torchrun's ranks die with their
launcher; what a step left running is found and killed), and the table reports every failure and lands in $OUT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_imports import REPO

# A launcher (the parent) that starts one worker in its own session, as torchrun does, prints its pid and waits.
LAUNCHER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE)
print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
worker.wait()
"""
WORKER = """
import sys, time
sys.path.insert(0, {repo!r})
if {die!r}:
    from bench.processes import die_with_parent
    die_with_parent()
print("ready", flush=True)
time.sleep(120)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):  # dead, not yet reaped by whoever adopted it
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("die", [True, False], ids=["die_with_parent", "without"])
def test_a_worker_in_its_own_session_dies_with_its_killed_launcher_only_when_asked(die):
    worker_code = WORKER.format(repo=str(REPO), die=die)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, worker_code], stdout=subprocess.PIPE, text=True)
    pid_text, ready = launcher.stdout.readline().split()
    worker = int(pid_text)
    assert ready == "ready"
    try:
        launcher.kill()  # what `timeout -k` or subprocess.run(timeout=...) does to torchrun's agent
        launcher.wait()
        assert _gone(worker, 5.0) is die
    finally:
        if not _gone(worker, 0):
            os.kill(worker, signal.SIGKILL)


def _wait_until_its_environment_shows(pid: int, entry: str, timeout: float = 10.0) -> None:
    """Popen returns when exec closes its error pipe, which the kernel does before it sets the new program's
    environment up (begin_new_exec, then create_elf_tables): /proc/<pid>/environ reads empty in between, a window a
    loaded CI machine can hit."""
    deadline = time.monotonic() + timeout
    while entry.encode() not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        assert time.monotonic() < deadline, f"pid {pid} never showed {entry} in its environment"
        time.sleep(0.01)


def test_leftovers_finds_and_kills_what_a_step_left_in_another_session():
    marker = f"test.{os.getpid()}.{time.monotonic_ns()}"
    env = {**os.environ, "WANVACE_GPU_STEP": marker}
    stray = subprocess.Popen(["sleep", "120"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)  # not the step's: left alone
    try:
        _wait_until_its_environment_shows(stray.pid, f"WANVACE_GPU_STEP={marker}")
        assert gpu_check.leftovers(marker, kill=True) == 1
        stray.wait(timeout=5)
        assert stray.returncode == -signal.SIGKILL
        assert other.poll() is None
        assert gpu_check.leftovers(marker, kill=True) == 0
    finally:
        for process in (stray, other):
            if process.poll() is None:
                process.kill()
                process.wait()


def _report(rows: list[dict]) -> dict:
    return {"bench": "fast path vs ComfyUI", "device": "cuda", "config": "c", "time_unit": "per CFG step", "rows": rows}


def test_the_table_names_every_failure_and_writes_its_files_to_out(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    steps = [
        ("machine probe", "gpu", "ok", "31", "75", "probe.json", "30"),
        ("fast path 480", "gpu", "FAILED (exit 1)", "140", "200", "fast.json", "150"),
        ("offload 480", "gpu", "TIMEOUT", "130", "130", "offload.json", "90"),
        ("VAE tiling 720", "extra", "skipped (budget)", "0", "60", "vae.json", "40"),
    ]
    (work / "steps.tsv").write_text("".join("\t".join(step) + "\n" for step in steps))
    (work / "probe.json").write_text(
        json.dumps({**_report([{"row": "ceiling: bf16 GEMM", "seconds": 0.0014, "note": "785 TFLOP/s"}]), "bench": "p"})
    )
    rows = [
        {"row": "480 today", "seconds": 0.9, "spread": 0.04, "timed": 3, "peak_gib": 12.0, "ratios": {}, "note": ""},
        {"row": "480 ComfyUI_best", "seconds": None, "failed": "ImportError: no comfy_kitchen"},
    ]
    (work / "fast.json").write_text(json.dumps(_report(rows)))
    (out / "junit.xml").parent.mkdir()
    (out / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_lora" name="test_a"/>'
        '<testcase classname="tests.test_offload" name="test_b"><failure message="x"/></testcase></testsuite>'
        "</testsuites>"
    )
    (work / "steps.tsv").write_text(
        (work / "steps.tsv").read_text() + "gpu tests\ttests\tFAILED (exit 1)\t70\t120\t-\t75\n"
    )
    gpu_check.table(work, out, quiet=True)
    text = (out / "gpu_check_table.txt").read_text()
    assert "480 ComfyUI_best" in text and "FAILED: ImportError: no comfy_kitchen" in text
    assert "900.00 ms ±  2%   12.0 GiB" in text and "1.40 ms" in text
    assert "tests (gpu-marked): 1 passed, 1 failed, 0 skipped, 0 errors" in text and "test_offload::test_b" in text
    result = text.strip().splitlines()[-1]
    for failure in ("fast path 480: FAILED (exit 1)", "offload 480: TIMEOUT", "480 ComfyUI_best failed", "gpu tests"):
        assert failure in result, result
    assert "VAE" not in result  # an extra left out for lack of budget is not a failure
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [step["name"] for step in summary["steps"]][:2] == ["machine probe", "fast path 480"]
    assert len(summary["reports"]) == 2 and summary["result"] != "ok"
