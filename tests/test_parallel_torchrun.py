"""Two "machines" on one host: two `torchrun` agents (node ranks 0 and 1, one CPU worker each) meet over a c10d
rendezvous on 127.0.0.1, and this process plays ComfyUI, connecting to rank 0's control address
(`launcher=torchrun`).

Shown: the latents equal the local launcher's and the single-process result bitwise; releasing the model
leaves the torchrun workers up for the next load; a ComfyUI that dies mid-run does not take them down;
a client of another world size or with the wrong key is refused; terminating torchrun leaves no process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample
from wanvace_core.parallel import ParallelOptions, WanVACEWorkerError
from wanvace_core.parallel.launcher import cpu_threads_per_worker

# The references here run in this process and must equal two workers bitwise.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("threads_like_two_workers")]

REPO = Path(__file__).resolve().parents[1]
KEY = "wanvace-torchrun-test-key"
SETTINGS = SamplerSettings(seed=7, steps=4, cfg=5.0, cfg_low_noise=4.0)
OTHER = SamplerSettings(seed=8, steps=4, cfg=5.0, cfg_low_noise=4.0)
MODE = {"shard": "none", "cfg_parallel": True}
# Further modes, each compared with the same mode under the local launcher (bitwise: the same ranks' work).
OTHER_MODES = {
    "fsdp": {"shard": "fsdp", "cfg_parallel": False},
    "fsdp+ulysses2": {"shard": "fsdp", "ulysses_degree": 2, "cfg_parallel": False},
}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _wait_gone(pids, within_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


@dataclass
class Torchrun:
    """The two torchrun agents ("machines"), each running one worker rank; `start` begins a fresh job."""

    folder: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    endpoint: str = ""
    jobs: int = 0
    ended: list[int] = field(default_factory=list)  # pids of earlier jobs' agents and workers

    def start(self) -> None:
        self.jobs += 1
        rendezvous, serve = _free_port(), _free_port()
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            OMP_NUM_THREADS=str(cpu_threads_per_worker(2)),  # as the local launcher's workers and the references
            WANVACE_WORKER_KEY=KEY,
        )
        for name in ("WANVACE_WORKER_DEVICES", "WANVACE_WORKER_PARENT"):
            env.pop(name, None)  # torchrun workers place themselves and outlive any one ComfyUI
        self.agents, self.logs, self.endpoint = [], [], f"127.0.0.1:{serve}"
        for node in (0, 1):
            command = [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous}"),
                *("--rdzv-id", f"wanvace-test-{rendezvous}", "--local-addr", "127.0.0.1"),
                *("-m", "wanvace_core.worker", "--serve", self.endpoint),
            ]
            self.logs.append(self.folder / f"job{self.jobs}-node{node}.log")
            with open(self.logs[-1], "wb") as log:
                self.agents.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
                )
        deadline = time.monotonic() + 240
        while "WANVACE_WORKER_READY" not in self.log(0):
            assert not self.exited() and time.monotonic() < deadline, self.tails()
            time.sleep(0.5)

    def exited(self) -> list[tuple[int, int]]:
        """(node, exit code) of the agents that ended."""
        return [(node, agent.returncode) for node, agent in enumerate(self.agents) if agent.poll() is not None]

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The `python -m wanvace_core.worker` processes each agent runs (one per node)."""
        return [pid for agent in self.agents for pid in _children(agent.pid)]

    def tails(self) -> str:
        # rank 1 polls the store every few seconds; torch 2.11 logs each poll's timeout, which says nothing
        lines = lambda node: [line for line in self.log(node).splitlines() if "socket.cpp" not in line]  # noqa: E731
        return "\n".join(f"--- node {node} ---\n" + "\n".join(lines(node)[-40:]) for node in range(len(self.logs)))

    def options(self, **kwargs) -> ParallelOptions:
        fields = {"devices": ("cpu", "cpu"), **MODE, "launcher": "torchrun", "endpoint": self.endpoint, **kwargs}
        return ParallelOptions(**fields)

    def while_running(self, work, within_s: float):
        """work() in a thread, failing as soon as a torchrun agent exits (a connect would wait minutes for it)."""
        outcome = {}

        def run() -> None:
            try:
                outcome["value"] = work()
            except BaseException as error:  # handed to the test below
                outcome["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + within_s
        while thread.is_alive():
            thread.join(0.5)
            if self.exited():
                pytest.fail(f"torchrun agent(s) (node, code) {self.exited()} exited\n{self.tails()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no result within {within_s} s\n{self.tails()}")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def terminate(self) -> None:
        self.ended += [agent.pid for agent in self.agents] + self.worker_pids()
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def _load_and_sample(folder: Path, options: ParallelOptions, cond) -> torch.Tensor:
    model = load_pipeline(folder, "fp32", parallel=options)
    try:
        return sample(model, cond, SETTINGS).latents
    finally:
        model.remote.close()


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    job = Torchrun(tmp_path_factory.mktemp("torchrun"))
    try:
        job.start()
        yield job
    finally:
        job.terminate()


@pytest.fixture(scope="module")
def reference(tiny_folder):
    model = load_pipeline(tiny_folder, "fp32")
    cond = prepare_conditioning(
        model, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=WIDTH, height=HEIGHT, length=LENGTH)
    )
    return model, cond


@pytest.fixture
def worker_key(monkeypatch, torchrun):
    """The torchrun workers' key for this process, and workers that run: a job that an earlier test ended (a
    failing one) is replaced, so that each test shows its own outcome."""
    if torchrun.exited():
        torchrun.terminate()
        torchrun.start()
    monkeypatch.setenv("WANVACE_WORKER_KEY", KEY)


@pytest.mark.one_set
def test_torchrun_workers_equal_the_local_launcher_and_one_process_and_outlive_a_release(
    torchrun, reference, tiny_folder, worker_key
):
    model, cond = reference
    expected = {settings.seed: sample(model, cond, settings).latents for settings in (SETTINGS, OTHER)}
    local = load_pipeline(tiny_folder, "fp32", parallel=ParallelOptions(devices=("cpu", "cpu"), **MODE))
    try:
        local_latents = sample(local, cond, SETTINGS).latents
    finally:
        local.remote.close()
    assert torch.equal(local_latents, expected[SETTINGS.seed])

    workers = torchrun.worker_pids()
    assert len(workers) == 2, torchrun.tails()
    remote = load_pipeline(tiny_folder, "fp32", parallel=torchrun.options())
    assert remote.remote.workers is None  # nothing started here: the torchrun ranks serve it
    try:
        for settings in (SETTINGS, OTHER, SETTINGS):
            progress = []
            got = sample(remote, cond, settings, callback=lambda i, n, _l, seen=progress: seen.append((i, n)))
            assert torch.equal(got.latents, expected[settings.seed]), torchrun.tails()
            assert progress == [(i, settings.steps) for i in range(settings.steps)]
    finally:
        remote.remote.close()
    assert torch.equal(got.latents, local_latents)

    # Released, not stopped: the same torchrun workers load the model again.
    time.sleep(1.0)
    assert all(agent.poll() is None for agent in torchrun.agents), torchrun.tails()
    assert torchrun.worker_pids() == workers
    again = load_pipeline(tiny_folder, "fp32", parallel=torchrun.options())
    try:
        assert torch.equal(sample(again, cond, OTHER).latents, expected[OTHER.seed])
    finally:
        again.remote.close()
    assert torchrun.worker_pids() == workers


def test_a_cancel_stops_the_torchrun_workers_within_a_step_and_they_serve_on(
    torchrun, reference, tiny_folder, worker_key
):
    model, cond = reference
    long = SamplerSettings(seed=7, steps=12, cfg=5.0, cfg_low_noise=4.0)
    remote = load_pipeline(tiny_folder, "fp32", parallel=torchrun.options())
    seen = []

    class Cancel(Exception):
        pass

    def cancel_at_two(index, _total, _latents):
        seen.append(index)
        if index == 1:
            raise Cancel

    try:
        with pytest.raises(Cancel):
            sample(remote, cond, long, callback=cancel_at_two)
        assert seen == [0, 1]
        assert torch.equal(sample(remote, cond, SETTINGS).latents, sample(model, cond, SETTINGS).latents)
    finally:
        remote.remote.close()


@pytest.mark.parametrize("name", OTHER_MODES)
def test_other_modes_through_torchrun_equal_the_local_launcher(name, torchrun, reference, tiny_folder, worker_key):
    _model, cond = reference
    mode = {**MODE, **OTHER_MODES[name]}
    local = _load_and_sample(tiny_folder, ParallelOptions(devices=("cpu", "cpu"), **mode), cond)
    got = torchrun.while_running(lambda: _load_and_sample(tiny_folder, torchrun.options(**mode), cond), within_s=180)
    assert torch.equal(got, local)


def test_a_world_size_that_does_not_match_the_torchrun_ranks_is_refused_and_they_serve_on(
    torchrun, reference, tiny_folder, worker_key
):
    model, cond = reference
    with pytest.raises(WanVACEWorkerError, match="are 2 ranks, but devices lists 4"):
        load_pipeline(tiny_folder, "fp32", parallel=torchrun.options(devices=("cpu",) * 4))
    got = torchrun.while_running(lambda: _load_and_sample(tiny_folder, torchrun.options(), cond), within_s=120)
    assert torch.equal(got, sample(model, cond, SETTINGS).latents)


@pytest.mark.one_set
def test_a_comfyui_that_dies_mid_run_leaves_the_torchrun_workers_serving(torchrun, reference, tiny_folder, worker_key):
    model, cond = reference
    script = textwrap.dedent(
        f"""
        import os
        from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
        from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample
        from wanvace_core.parallel import ParallelOptions
        model = load_pipeline({str(tiny_folder)!r}, "fp32", parallel={torchrun.options(timeout_s=20.0)!r})
        cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
        def die(index, total, latents):
            print("STEP", index, flush=True)
            if index == 1:
                os.kill(os.getpid(), 9)
        sample(model, cond, SamplerSettings(seed=7, steps=12, cfg=5.0, cfg_low_noise=4.0), callback=die)
        """
    )
    env = {**os.environ, "WANVACE_WORKER_KEY": KEY, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == -signal.SIGKILL and "STEP 1" in result.stdout, result.stdout + result.stderr
    workers = torchrun.worker_pids()
    started = time.monotonic()
    got = torchrun.while_running(lambda: _load_and_sample(tiny_folder, torchrun.options(), cond), within_s=120)
    assert torch.equal(got, sample(model, cond, SETTINGS).latents)
    assert time.monotonic() - started < 60, "the torchrun workers took long to notice that ComfyUI was gone"
    assert torchrun.worker_pids() == workers, torchrun.tails()


def test_a_client_with_the_wrong_key_is_refused_and_the_torchrun_workers_serve_on(
    torchrun, reference, tiny_folder, worker_key, monkeypatch
):
    model, cond = reference
    monkeypatch.setenv("WANVACE_WORKER_KEY", "not-the-key")

    def refused() -> None:
        with pytest.raises(WanVACEWorkerError, match="WANVACE_WORKER_KEY"):
            load_pipeline(tiny_folder, "fp32", parallel=torchrun.options())

    torchrun.while_running(refused, within_s=60)
    monkeypatch.setenv("WANVACE_WORKER_KEY", KEY)
    got = torchrun.while_running(lambda: _load_and_sample(tiny_folder, torchrun.options(), cond), within_s=120)
    assert torch.equal(got, sample(model, cond, SETTINGS).latents)


def test_terminating_torchrun_leaves_no_worker_process(torchrun):
    agents = [agent.pid for agent in torchrun.agents if agent.poll() is None]
    workers = torchrun.worker_pids()
    torchrun.terminate()
    assert _wait_gone(agents + workers) == [], torchrun.tails()
    assert all(_children(pid) == [] for pid in agents)
    assert _wait_gone(torchrun.ended) == [], "a process of an earlier torchrun job is left"
