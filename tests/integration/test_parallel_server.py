"""Parallel workers through a real ComfyUI: `WanVACEParallelOptions` (devices=cpu,cpu: two gloo worker processes
that the server starts) on the loader's `parallel` input.

Shown per parallel mode: consecutive prompts equal the same workflow without parallel options (bitwise for CFG
parallel on whole experts, within TOLERANCE for FSDP and Ulysses), and a repeated prompt gives the same latents;
a prompt cancelled while the workers run is reported interrupted, the workers survive it and the next prompt
gives the uncancelled result; POST /free stops the workers and the next prompt starts fresh ones with the same
result. Then: the shipped workflows' bf16 through the workers; invalid combinations are refused at queue time
naming the input; and a ComfyUI that stops (SIGTERM to the server process alone) leaves no worker behind.

The server is this module's own (its last test stops it); each worker start costs 10-20 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scripts.comfy_server import ComfyServer
from tests.support.comfyui import require_comfyui
from wanvace_core.parallel import DEFAULT_ENDPOINT
from wanvace_core.parallel.launcher import cpu_threads_per_worker
from workflow_graphs import for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
PARALLEL_NODE = "800"
SEEDS = (31, 32)
CANCEL_STEPS = 100
WORKER_MODULE = "wanvace_core.worker"
# The modes run in fp32; the shipped workflows' bf16 has a test of its own below.
DTYPE = "fp32"
TOLERANCE = 1e-4

# (options of WanVACEParallelOptions, bitwise equal to the workflow without them?). CFG parallel on whole experts
# is; FSDP gathers each block into fresh buffers, where CPU GEMM kernels may take another path than on the
# weights ComfyUI loads in place (tests/test_parallel_modes.py compares it bitwise to a rehomed reference), and
# Ulysses sums attention over all-to-all'd head groups in another order: within TOLERANCE (latents ~5).
MODES = [
    pytest.param(({"shard": "none", "ulysses_degree": 1, "cfg_parallel": True}, True), id="none+cfg_parallel"),
    pytest.param(({"shard": "fsdp", "ulysses_degree": 1, "cfg_parallel": False}, False), id="fsdp"),
    pytest.param(({"shard": "fsdp", "ulysses_degree": 2, "cfg_parallel": False}, False), id="fsdp+ulysses2"),
]


def _workflow(
    seed: int, prefix: str, parallel: dict | None, dtype: str = DTYPE, shipped: str = "wanvace_t2v.json", **sampler
) -> dict:
    """The shipped workflow `shipped` on the tiny model, with `parallel` options (None: without), its latents saved."""
    workflow = for_tiny_model(json.loads((API_DIR / shipped).read_text()))
    ids = {node["class_type"]: key for key, node in workflow.items()}
    workflow[ids["WanVACEModelLoader"]]["inputs"]["dtype"] = dtype
    workflow[ids["WanVACESampler"]]["inputs"].update(seed=seed, **sampler)
    if parallel is not None:
        workflow[PARALLEL_NODE] = {"class_type": "WanVACEParallelOptions", "inputs": _parallel_inputs(**parallel)}
        workflow[ids["WanVACEModelLoader"]]["inputs"]["parallel"] = [PARALLEL_NODE, 0]
    # The latents themselves (no decode, no video): what the sampler produced, exactly.
    for class_type in ("WanVACEDecode", "CreateVideo", "SaveVideo"):
        del workflow[ids[class_type]]
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [ids["WanVACESampler"], 0], "filename_prefix": prefix},
    }
    return workflow


def _parallel_inputs(**values) -> dict:
    inputs = {
        "devices": "cpu,cpu",
        "shard": "none",
        "replicate_size": 1,
        "ulysses_degree": 1,
        "cfg_parallel": False,
        "launcher": "local",
        "endpoint": DEFAULT_ENDPOINT,
        "timeout_s": 120.0,  # a hung worker fails the prompt in 2 minutes, not 10
    }
    inputs.update(values)
    return inputs


def _sampler_id(workflow: dict) -> str:
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == "WanVACESampler"]
    return node_id


def _latent(server: ComfyServer, workflow: dict, sampled: bool = True) -> torch.Tensor:
    """The latents a prompt saved; `sampled`: the sampler really ran (ComfyUI did not serve it from its cache)."""
    result = server.run_prompt(workflow, timeout=300)
    assert result.status == "success", (result.error, server.log_tail())
    if sampled:
        result.assert_ran(_sampler_id(workflow))
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _same(got: torch.Tensor, expected: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(got, expected)
    return got.shape == expected.shape and (got - expected).abs().max().item() <= TOLERANCE


# --- processes ---------------------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None once the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _worker_pids(parent: int) -> list[int]:
    """Live `python -m wanvace_core.worker` processes whose parent is `parent` (the ComfyUI server)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == parent and WORKER_MODULE in _cmdline(int(entry)):
                found.append(int(entry))
    return sorted(found)


def _workers_of_parent(parent: int) -> list[int]:
    """Live worker processes started for `parent`, wherever they were reparented (WANVACE_WORKER_PARENT)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or WORKER_MODULE not in _cmdline(int(entry)) or _stat(int(entry)) is None:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:
            continue
        if f"WANVACE_WORKER_PARENT={parent}".encode() in variables:
            found.append(int(entry))
    return sorted(found)


def _wait_gone(pids, within_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_stat(pid) is not None for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if _stat(pid) is not None]


# --- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, comfy_base):
    """A server of its own (its thread count; the last test stops it), on the session's model files."""
    require_comfyui()
    base = tmp_path_factory.mktemp("comfy_parallel")
    # The references run in the server process and must equal two workers bitwise (see `threads_of_workers`).
    server = ComfyServer(base, env={"OMP_NUM_THREADS": str(cpu_threads_per_worker(2))}, models_from=comfy_base)
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def references(server) -> dict[int, torch.Tensor]:
    """The same workflow without parallel options, per seed: the experts in the ComfyUI process."""
    return {seed: _latent(server, _workflow(seed, f"plain/{seed}", None)) for seed in SEEDS}


@pytest.fixture(scope="module", params=MODES)
def mode(request) -> tuple[dict, bool]:
    return request.param


# --- per mode ----------------------------------------------------------------------------------------------------


def test_consecutive_prompts_equal_the_workflow_without_parallel_options(server, references, mode):
    options, exact = mode
    first, second = SEEDS
    tag = "-".join(f"{key}{value}" for key, value in options.items())
    latents = [_latent(server, _workflow(seed, f"{tag}/consecutive{seed}", options)) for seed in (first, second)]
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2, (workers, server.log_tail())
    latents.append(_latent(server, _workflow(first, f"{tag}/again{first}", options)))

    assert _same(latents[0], references[first], exact), (latents[0] - references[first]).abs().max()
    assert _same(latents[1], references[second], exact), (latents[1] - references[second]).abs().max()
    assert not torch.equal(latents[0], latents[1])
    assert torch.equal(latents[2], latents[0]), "repeating a prompt changed its latents"
    assert _worker_pids(server.proc.pid) == workers, "the workers were restarted between prompts"


# A cancel and an unload stop a run and the workers the same way in every mode: each is checked in one.
@pytest.mark.parametrize("mode", [MODES[0]], indirect=True)
def test_cancel_mid_prompt_is_interrupted_and_the_next_prompt_gives_the_same_result(server, references, mode):
    options, exact = mode
    tag = "-".join(f"{key}{value}" for key, value in options.items())
    seed, other = SEEDS[1], SEEDS[0]
    long_run = _workflow(seed, f"{tag}/cancelled", options, steps=CANCEL_STEPS)
    _latent(server, _workflow(seed, f"{tag}/before_cancel", options), sampled=False)  # the workers are up
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2, workers

    cancelled = server.run_prompt(long_run, timeout=300, interrupt_after_progress=2)
    assert cancelled.status == "interrupted", (cancelled.status, cancelled.error)
    messages = [name for name, _data in cancelled.history["status"]["messages"]]
    assert "execution_interrupted" in messages and "execution_success" not in messages, messages
    steps_seen = [event["value"] for event in cancelled.progress_events() if event.get("node") == _sampler_id(long_run)]
    assert steps_seen and max(steps_seen) < CANCEL_STEPS, steps_seen
    assert not [p for p in cancelled.output_files() if p.suffix == ".latent"]

    # ComfyUI keeps the last prompt's outputs across the interrupted one: the other seed makes the workers sample.
    after = _latent(server, _workflow(other, f"{tag}/after_cancel", options))
    assert _same(after, references[other], exact)
    assert _worker_pids(server.proc.pid) == workers, "a cancel should stop the run, not the workers"


@pytest.mark.parametrize("mode", [MODES[0]], indirect=True)
def test_unload_stops_the_workers_and_the_next_prompt_starts_fresh_ones(server, references, mode):
    options, exact = mode
    tag = "-".join(f"{key}{value}" for key, value in options.items())
    seed = SEEDS[1]
    before = _latent(server, _workflow(seed, f"{tag}/before_free", options), sampled=False)
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2, workers

    server.free(unload_models=True, free_memory=True)
    assert _wait_gone(workers) == [], f"workers {workers} still run after POST /free\n{server.log_tail()}"
    assert _worker_pids(server.proc.pid) == []

    after = _latent(server, _workflow(seed, f"{tag}/after_free", options))
    fresh = _worker_pids(server.proc.pid)
    assert len(fresh) == 2 and set(fresh).isdisjoint(workers), (workers, fresh)
    assert torch.equal(after, before)
    assert _same(after, references[seed], exact)


def _comfy_sampler_workflow(seed: int, prefix: str, parallel: dict | None, sampler_name: str) -> dict:
    """The shipped KSamplerSelect + WanVACE Scheduler graph at 4 steps with `sampler_name`, in fp32, its latents
    saved."""
    workflow = _workflow(seed, prefix, parallel)
    shipped = json.loads((API_DIR / "wanvace_t2v_comfy_sampler.json").read_text())
    ids = {node["class_type"]: key for key, node in workflow.items()}
    model, sampler = [ids["WanVACEModelLoader"], 0], ids["WanVACESampler"]
    (select,) = [node for node in shipped.values() if node["class_type"] == "KSamplerSelect"]
    (scheduler,) = [node for node in shipped.values() if node["class_type"] == "WanVACEScheduler"]
    workflow["810"] = {"class_type": "KSamplerSelect", "inputs": {**select["inputs"], "sampler_name": sampler_name}}
    workflow["811"] = {"class_type": "WanVACEScheduler", "inputs": {**scheduler["inputs"], "model": model, "steps": 4}}
    workflow[sampler]["inputs"].update(steps=4, sampler=["810", 0], sigmas=["811", 0])
    return workflow


@pytest.mark.parametrize("mode", [MODES[0]], indirect=True)
def test_comfyui_samplers_step_the_experts_in_the_workers_and_equal_them_without(server, mode):
    """ComfyUI's SAMPLER runs in the server and sends each denoiser call to the workers: heun (two calls a step) and
    dpmpp_2m_sde (its own seeded noise) equal the same graph without parallel options, bitwise."""
    options, exact = mode
    for name in ("heun", "dpmpp_2m_sde"):
        plain = _latent(server, _comfy_sampler_workflow(SEEDS[0], f"comfy_sampler/{name}/plain", None, name))
        parallel = _latent(server, _comfy_sampler_workflow(SEEDS[0], f"comfy_sampler/{name}/parallel", options, name))
        assert len(_worker_pids(server.proc.pid)) == 2, server.log_tail()
        assert _same(parallel, plain, exact), (name, (parallel - plain).abs().max())


def _lightning_workflow(seed: int, prefix: str, parallel: dict | None) -> dict:
    """The shipped 4-step Lightning graph (a LoRA per expert, NAG at cfg 1, the distill schedule) in fp32, its latents
    saved."""
    return _workflow(seed, prefix, parallel, shipped="wanvace_t2v_lightning.json")


@pytest.mark.parametrize("mode", [MODES[1]], indirect=True)
def test_loras_run_on_sharded_workers_and_equal_them_without(server, mode):
    """The Lightning graph's two LoRAs (and NAG) on FSDP-sharded workers: each rank applies them to its experts."""
    options, exact = mode
    assert options["shard"] == "fsdp"
    plain = _latent(server, _lightning_workflow(SEEDS[0], "lightning/plain", None))
    parallel = _latent(server, _lightning_workflow(SEEDS[0], "lightning/fsdp", options))
    assert len(_worker_pids(server.proc.pid)) == 2, server.log_tail()
    assert _same(parallel, plain, exact), (parallel - plain).abs().max()


# --- whatever the mode -------------------------------------------------------------------------------------------


def test_the_shipped_bf16_workflow_runs_in_parallel_and_equals_it_without(server):
    options = {"shard": "none", "cfg_parallel": True}
    plain = _latent(server, _workflow(SEEDS[0], "bf16/plain", None, dtype="bf16"))
    parallel = _latent(server, _workflow(SEEDS[0], "bf16/parallel", options, dtype="bf16"))
    assert torch.equal(parallel, plain)


@pytest.mark.parametrize(
    ("values", "name", "fragment"),
    [
        (
            {"ulysses_degree": 3, "cfg_parallel": False},
            "ulysses_degree",
            "ulysses_degree=3 must divide the 2 device(s) listed",
        ),
        ({"devices": "cpu,cpu,cpu", "cfg_parallel": True}, "cfg_parallel", "cfg_parallel needs an even number"),
        ({"shard": "hsdp", "replicate_size": 2}, "replicate_size", "replicate_size=2 with shard=hsdp"),
        ({"devices": "cpu,cuda:0"}, "devices", "mixes CPU and GPU workers"),
    ],
)
def test_invalid_combinations_are_refused_at_queue_time_naming_the_input(server, values, name, fragment):
    workflow = _workflow(SEEDS[0], "invalid", {"shard": "none", "cfg_parallel": True, **values})
    before = _worker_pids(server.proc.pid)
    result = server.run_prompt(workflow, timeout=60)
    assert result.status == "rejected", (result.status, result.error)
    node_errors = result.node_errors
    assert list(node_errors) == [PARALLEL_NODE], node_errors
    errors = node_errors[PARALLEL_NODE]["errors"]
    named = [error for error in errors if error["extra_info"]["input_name"] == name]
    assert named, json.dumps(errors, indent=1)
    assert all(fragment in error["details"] for error in errors), json.dumps(errors, indent=1)
    assert named[0]["details"].startswith(f"{name} - "), named[0]
    assert _worker_pids(server.proc.pid) == before, "a refused prompt started or stopped workers"


def test_a_comfyui_that_stops_leaves_no_worker_process(server):
    options = {"shard": "none", "cfg_parallel": True}
    if len(_worker_pids(server.proc.pid)) != 2:
        _latent(server, _workflow(SEEDS[0], "before_stop", options))
    pid = server.proc.pid
    workers = _worker_pids(pid)
    assert len(workers) == 2, workers
    # SIGTERM to the server alone (ComfyUI leaves without running finalizers), not to its process group as the
    # fixture's stop() does: nothing but the pack itself may end the workers.
    os.kill(pid, signal.SIGTERM)
    server.proc.wait(timeout=60)
    try:
        assert _wait_gone(workers) == [], f"workers {workers} outlived ComfyUI"
        assert _workers_of_parent(pid) == []
    finally:
        for worker in _workers_of_parent(pid):  # this test's leftovers only: the workers of the server it stopped
            os.kill(worker, signal.SIGKILL)
