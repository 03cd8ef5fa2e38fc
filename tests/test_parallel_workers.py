"""The parallel workers as ComfyUI uses them: started by the loader, serving prompts, surviving cancel,
failing cleanly when a worker dies or hangs, and leaving nothing behind.

The experts run in `python -m wanvace_core.worker` processes on gloo CPU ranks (`devices=cpu,cpu`); the
reference is the same tiny pipeline loaded in this process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.support.lora_files import lora_content, write_lora
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import (
    CacheOptions,
    ContextWindowOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.parallel import ParallelOptions, WanVACEWorkerError, messages
from wanvace_core.runtime.lora import LoraPatch

# The references here run in this process and must equal two workers bitwise.
pytestmark = pytest.mark.usefixtures("threads_like_two_workers")

SETTINGS = SamplerSettings(seed=5, steps=6, cfg=5.0, cfg_low_noise=4.0)
# Caches some steps of both experts on the tiny model (checked below: a cache that never hits proves nothing).
CACHE = CacheOptions(residual_diff_threshold=0.3, high_noise=ExpertCacheLimits(1), low_noise=ExpertCacheLimits(1))


def _pids(model) -> list[int]:
    return [process.pid for process in model.remote.workers.processes]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie is gone for every purpose but its parent's bookkeeping.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pids, within_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


@pytest.fixture(scope="module")
def reference(tiny_folder):
    model = load_pipeline(tiny_folder, "fp32")
    cond = prepare_conditioning(
        model, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=WIDTH, height=HEIGHT, length=LENGTH)
    )
    return model, cond


@pytest.fixture(scope="module")
def cfg_parallel_model(tiny_folder):
    model = load_pipeline(
        tiny_folder, "fp32", parallel=ParallelOptions(devices=("cpu", "cpu"), shard="none", cfg_parallel=True)
    )
    yield model
    model.remote.close()


def test_cfg_parallel_equals_one_process_bitwise_with_and_without_cache(reference, cfg_parallel_model):
    model, cond = reference
    for cache in (None, CACHE):
        expected = sample(model, cond, SETTINGS, cache=cache)
        got = sample(cfg_parallel_model, cond, SETTINGS, cache=cache)
        assert torch.equal(got.latents, expected.latents)
        assert got.cache_report == expected.cache_report
    report = got.cache_report
    assert all(expert.cached_steps and expert.cfg_cached_steps for expert in report.experts), report


def test_guidance_rules_and_hooks_run_in_the_workers_and_equal_one_process_bitwise(reference, cfg_parallel_model):
    """CFG parallel: each rank computes one branch, both combine (APG's momentum, CFG-Zero*) after the exchange; SLG
    finds the negative pass on its rank, NAG and RIFLEx run inside the experts there."""
    from wanvace_core.generation.guidance import APGOptions, ExpertGuidance, GuidanceOptions
    from wanvace_core.runtime.attention_guidance import NAGOptions, SkipLayerOptions

    model, cond = reference
    rules = GuidanceOptions(
        high_noise=ExpertGuidance(apg=APGOptions(momentum=-0.5)),
        low_noise=ExpertGuidance(cfg_zero_star=True, zero_init_steps=1),
        slg=SkipLayerOptions(blocks=(1,), start_percent=0.0),
        riflex_index=-1,
    )
    expected = sample(model, cond, SETTINGS, rules=rules).latents
    assert not torch.equal(expected, sample(model, cond, SETTINGS).latents)
    assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS, rules=rules).latents, expected)
    nag_settings = SamplerSettings(seed=5, steps=6, cfg=5.0, cfg_low_noise=1.0)
    nag = GuidanceOptions(nag=NAGOptions())
    expected = sample(model, cond, nag_settings, rules=nag).latents
    assert torch.equal(sample(cfg_parallel_model, cond, nag_settings, rules=nag).latents, expected)


class _Heun:
    """Heun's method over the sigmas (k-diffusion's `sample_heun`: two denoiser calls per step, one on the last step),
    the first call of each step asking for the parts, which it records: an outside solver as `stepping.Stepper`."""

    def __init__(self) -> None:
        self.parts = []

    def call_sigmas(self, sigmas):
        return tuple(float(s) for i in range(len(sigmas) - 1) for s in sigmas[i : i + 2] if s > 0)

    def run(self, denoiser, noise, sigmas, seed, on_step):
        x = noise * sigmas[0]
        for index in range(len(sigmas) - 1):
            sigma, after = sigmas[index], sigmas[index + 1]
            parts = denoiser(x, sigma, parts=True)
            self.parts.append(parts)
            slope = (x - parts.denoised) / sigma
            ahead = x + (after - sigma) * slope
            if after > 0:
                ahead = x + (after - sigma) * (slope + (ahead - denoiser(ahead, after)) / after) / 2
            on_step(index, len(sigmas) - 1, parts.denoised)
            x = ahead
        return x


def test_an_outside_solver_steps_the_workers_and_equals_one_process_bitwise(reference, cfg_parallel_model):
    """ComfyUI's SAMPLER runs in ComfyUI's process and each of its denoiser calls is a round trip to the workers: the
    result, each call's parts (what CFG++ samplers read), the progress and the cache report equal one process."""
    model, cond = reference
    expected_solver, got_solver = _Heun(), _Heun()
    expected = sample(model, cond, SETTINGS, stepper=expected_solver)
    progress = []
    got = sample(
        cfg_parallel_model, cond, SETTINGS, stepper=got_solver, callback=lambda i, n, x0: progress.append((i, n, x0))
    )
    assert torch.equal(got.latents, expected.latents)
    assert not torch.equal(expected.latents, sample(model, cond, SETTINGS).latents)  # not the built-in scheduler
    for mine, theirs in zip(got_solver.parts, expected_solver.parts, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine[:3], theirs[:3], strict=True)) and mine[3] == theirs[3]
    assert [(i, n) for i, n, _ in progress] == [(i, SETTINGS.steps) for i in range(SETTINGS.steps)]
    assert torch.equal(progress[-1][2], expected_solver.parts[-1].denoised)
    # With step caching the workers count the solver's calls per expert, as one process does.
    expected = sample(model, cond, SETTINGS, stepper=_Heun(), cache=CACHE)
    got = sample(cfg_parallel_model, cond, SETTINGS, stepper=_Heun(), cache=CACHE)
    assert torch.equal(got.latents, expected.latents)
    assert got.cache_report == expected.cache_report
    assert any(expert.cached_steps for expert in got.cache_report.experts), got.cache_report


def test_a_cancelled_outside_solver_stops_the_workers_and_the_next_run_is_unchanged(reference, cfg_parallel_model):
    model, cond = reference
    pids = _pids(cfg_parallel_model)
    expected = sample(model, cond, SETTINGS, stepper=_Heun()).latents

    class Cancel(Exception):
        pass

    def cancel_at_two(index, _total, _x0):
        if index == 1:
            raise Cancel

    with pytest.raises(Cancel):
        sample(cfg_parallel_model, cond, SETTINGS, stepper=_Heun(), callback=cancel_at_two)

    class Failing(_Heun):
        def run(self, denoiser, noise, sigmas, seed, on_step):
            denoiser(noise * sigmas[0], sigmas[0])
            raise ValueError("the solver failed")

    with pytest.raises(ValueError, match="the solver failed"):
        sample(cfg_parallel_model, cond, SETTINGS, stepper=Failing())
    for _ in range(2):
        assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS, stepper=_Heun()).latents, expected)
    assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS).latents, sample(model, cond, SETTINGS).latents)
    assert _pids(cfg_parallel_model) == pids


def test_loras_merged_and_on_the_fly_run_in_the_workers_and_equal_one_process_bitwise(
    reference, cfg_parallel_model, tmp_path
):
    """The LoRA patches travel with each run; every rank reads the file and applies them (merged where the experts are
    whole on each rank, as here), also under an outside solver."""
    model, cond = reference
    path = write_lora(tmp_path / "lora.safetensors", lora_content(model, rank=4, seed=5, diffs=True), "comfy")
    plain = sample(model, cond, SETTINGS).latents
    for merge in (False, True):
        patch = LoraPatch(path, strength_high_noise=0.7, strength_low_noise=1.3, merge=merge)
        expected = sample(model.with_loras(patch), cond, SETTINGS).latents
        assert not torch.equal(expected, plain)
        assert torch.equal(sample(cfg_parallel_model.with_loras(patch), cond, SETTINGS).latents, expected), merge
    expected = sample(model.with_loras(patch), cond, SETTINGS, stepper=_Heun()).latents
    assert torch.equal(sample(cfg_parallel_model.with_loras(patch), cond, SETTINGS, stepper=_Heun()).latents, expected)
    assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS).latents, plain)  # the next run has no LoRA


def test_context_windows_run_in_the_workers_and_equal_one_process_bitwise(reference, cfg_parallel_model):
    model, cond = reference
    # LENGTH frames are 3 latent frames: 5-frame windows (2 latent) without overlap give 2 windows.
    windows = ContextWindowOptions(context_length=5, context_overlap=0, schedule="standard_static")
    expected = sample(model, cond, SETTINGS, windows=windows).latents
    assert not torch.equal(expected, sample(model, cond, SETTINGS).latents)
    assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS, windows=windows).latents, expected)
    # With the cache each window keeps its own cache state in the workers too, and the report counts window steps.
    cached = sample(model, cond, SETTINGS, windows=windows, cache=CACHE)
    assert all(expert.windows == 2 and expert.cached_steps for expert in cached.cache_report.experts)
    got = sample(cfg_parallel_model, cond, SETTINGS, windows=windows, cache=CACHE)
    assert torch.equal(got.latents, cached.latents)
    assert got.cache_report == cached.cache_report


def test_consecutive_prompts_and_a_cancel_keep_the_same_workers_and_result(reference, cfg_parallel_model):
    model, cond = reference
    pids = _pids(cfg_parallel_model)
    expected = sample(model, cond, SETTINGS).latents
    seen = []

    class Cancel(Exception):
        pass

    def cancel_at_two(index, total, latents):
        seen.append((index, total, latents.shape))
        if index == 1:
            raise Cancel

    with pytest.raises(Cancel):
        sample(cfg_parallel_model, cond, SETTINGS, callback=cancel_at_two)
    assert [step[0] for step in seen] == [0, 1]  # stopped within a step
    assert seen[0][2] == expected.shape
    for _ in range(2):
        progress = []
        got = sample(cfg_parallel_model, cond, SETTINGS, callback=lambda i, n, _l, seen=progress: seen.append((i, n)))
        assert torch.equal(got.latents, expected)
        assert progress == [(i, SETTINGS.steps) for i in range(SETTINGS.steps)]
    assert _pids(cfg_parallel_model) == pids


def test_a_cancel_that_arrives_after_its_run_ended_is_not_taken_for_the_next_request(reference, cfg_parallel_model):
    """ComfyUI cancels at a step's progress; when its process is slower to do so than the run is to finish its last
    steps (seen under load), the cancel reaches rank 0 after the run's answer. The next prompt must not fail on it."""
    model, cond = reference
    expected = sample(model, cond, SETTINGS).latents
    cfg_parallel_model.remote.conn.send_bytes(messages.encode("cancel"))
    assert torch.equal(sample(cfg_parallel_model, cond, SETTINGS).latents, expected)


def test_guidance_one_on_both_experts_is_refused_under_cfg_parallel(reference, cfg_parallel_model):
    _model, cond = reference
    with pytest.raises(WanVACEInputError, match="cfg_parallel is on but both guidance scales"):
        sample(cfg_parallel_model, cond, SamplerSettings(seed=1, steps=2, cfg=1.0, cfg_low_noise=1.0))


def _parallel(tiny_folder, **kwargs):
    options = {"devices": ("cpu", "cpu"), "shard": "none", "cfg_parallel": True, **kwargs}
    return load_pipeline(tiny_folder, "fp32", parallel=ParallelOptions(**options))


@pytest.mark.one_set
def test_a_killed_worker_fails_the_prompt_and_the_next_prompt_starts_fresh_workers(reference, tiny_folder):
    model, cond = reference
    expected = sample(model, cond, SETTINGS).latents
    parallel = _parallel(tiny_folder, timeout_s=60.0)
    old = _pids(parallel)

    def kill_rank_one(index, _total, _latents):
        if index == 1:
            os.kill(old[1], signal.SIGKILL)

    started = time.monotonic()
    with pytest.raises(WanVACEWorkerError, match=r"(rank 1 exited|closed the connection|failed)"):
        sample(parallel, cond, SETTINGS, callback=kill_rank_one)
    assert time.monotonic() - started < 60
    assert _wait_gone(old) == []
    got = sample(parallel, cond, SETTINGS)
    assert torch.equal(got.latents, expected)
    assert set(_pids(parallel)).isdisjoint(old)
    parallel.remote.close()


@pytest.mark.one_set
def test_a_hung_worker_times_out_and_is_stopped(reference, tiny_folder):
    model, cond = reference
    parallel = _parallel(tiny_folder, timeout_s=4.0)
    old = _pids(parallel)

    def hang_rank_one(index, _total, _latents):
        if index == 0:
            os.kill(old[1], signal.SIGSTOP)

    started = time.monotonic()
    with pytest.raises(WanVACEWorkerError, match="sent nothing for timeout_s=4 s"):
        sample(parallel, cond, SETTINGS, callback=hang_rank_one)
    assert time.monotonic() - started < 30
    assert _wait_gone(old) == []
    assert torch.equal(sample(parallel, cond, SETTINGS).latents, sample(model, cond, SETTINGS).latents)
    parallel.remote.close()


@pytest.mark.one_set
def test_freeing_the_model_stops_its_workers_and_their_ports_are_their_own(tiny_folder, monkeypatch):
    """A port this process finds free and closes again can be taken by another process before a worker binds it
    (EADDRINUSE, seen under load): starting the workers binds no socket here; rank 0 binds its ports itself."""
    bound = []
    real_bind = socket.socket.bind

    def recording_bind(sock, address):
        bound.append(address)
        return real_bind(sock, address)

    monkeypatch.setattr(socket.socket, "bind", recording_bind)
    parallel = _parallel(tiny_folder)
    monkeypatch.undo()
    assert bound == []
    host, port = parallel.remote.workers.control_address()
    assert host == "127.0.0.1" and port > 0
    pids = _pids(parallel)
    del parallel
    assert _wait_gone(pids) == []


@pytest.mark.one_set
def test_workers_exit_when_the_comfyui_process_dies(tiny_folder, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys
        from wanvace_core import load_pipeline
        from wanvace_core.parallel import ParallelOptions
        model = load_pipeline({str(tiny_folder)!r}, "fp32",
                              parallel=ParallelOptions(devices=("cpu", "cpu"), shard="none", cfg_parallel=True))
        print("PIDS", *(process.pid for process in model.remote.workers.processes), flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    pids = [int(pid) for line in result.stdout.splitlines() if line.startswith("PIDS") for pid in line.split()[1:]]
    assert len(pids) == 2, result.stdout + result.stderr
    assert _wait_gone(pids) == []


def test_a_message_of_another_protocol_version_is_refused():
    data = messages.encode("hello")
    tampered = torch.load(__import__("io").BytesIO(data), weights_only=True)
    tampered["version"] = messages.PROTOCOL_VERSION + 1
    buffer = __import__("io").BytesIO()
    torch.save(tampered, buffer)
    with pytest.raises(WanVACEWorkerError, match="protocol version"):
        messages.decode(buffer.getvalue())


def test_requests_of_720p_size_cross_the_store_whole():
    """A 720p request (control latents ~58 MB in bf16) crosses the rendezvous store intact, and is deleted after."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.support.distributed import hosted_store
    from wanvace_core.worker import StoreRelay

    host = hosted_store()
    client = dist.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=30))
    payload = torch.randn(1, 96, 21, 90, 160, dtype=torch.bfloat16)
    sender, receiver = StoreRelay(host, 0, 2), StoreRelay(client, 1, 2)
    request = sender.publish(messages.encode("sample", control=payload))
    received_id, data = receiver.receive()
    assert received_id == request
    assert torch.equal(messages.decode(data)["control"], payload)
    sender.publish(messages.encode("release"))  # deletes the previous request's chunks
    assert not host.check([f"wanvace/request{request}/0"])
