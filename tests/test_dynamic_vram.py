"""Our pipeline beside ComfyUI's Dynamic VRAM models, decided by ComfyUI's own model management.

Dynamic VRAM needs CUDA and comfy-aimdo, so a CPU cannot run it. What can run here is everything ComfyUI
decides: its real `comfy.model_management` (load_models_gpu, free_memory, the pin budget) and our real
`nodes/memory.py`, in a subprocess inside this set's ComfyUI tree, on a simulated 24 GiB device. The dynamic
models are stand-ins that answer model management as `ModelPatcherDynamic` does (`is_dynamic()`, pages
resident on the device, pinned host copies; `partially_unload` frees pages in 32 MiB steps, an unpatching
`detach` drops pages and pins), and comfy-aimdo's on-demand eviction is simulated where our weights
allocate: pages give way, lowest priority first, only for the bytes that do not fit. The old reservation
(a `load_models_gpu` per reservation, as before this change) runs beside the new one for comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import importlib.util, json, os, sys, types
sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository's own `nodes` package
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options

comfy.options.enable_args_parsing()
import torch
import comfy.model_management as mm
import comfy.model_patcher as mp

repo = os.environ["WANVACE_REPO"]
spec = importlib.util.spec_from_file_location("wanvace_pack", os.path.join(repo, "__init__.py"),
                                              submodule_search_locations=[repo])
sys.modules["wanvace_pack"] = importlib.util.module_from_spec(spec)
nodes_package = types.ModuleType("wanvace_pack.nodes")  # nodes/__init__ would import every node
nodes_package.__path__ = [os.path.join(repo, "nodes")]
sys.modules["wanvace_pack.nodes"] = nodes_package
from wanvace_pack.nodes import memory

GIB = 1024**3
PAGE = 32 * 1024**2  # comfy-aimdo's VBAR page
DEVICE = torch.device("cuda", 0)
TOTAL = 24 * GIB
HAS_DYNAMIC = hasattr(mp.ModelPatcher, "is_dynamic")
events = []
patchers = []  # everything holding memory on the simulated device, oldest first


def free_bytes(dev=None, torch_free_too=False):
    free = TOTAL - sum(p.loaded_size() for p in patchers)
    return (free, 0) if torch_free_too else free


mm.get_free_memory = free_bytes


class Ram:
    available = 64 * GIB


mm.psutil.virtual_memory = lambda: Ram


class DynamicModel(mp.ModelPatcher):
    # ModelPatcherDynamic as model management sees it: pages on the device, pinned host copies.
    def __init__(self, name, size, resident, pinned):
        module = type(name, (torch.nn.Module,), {})()
        module.dynamic_pins = {DEVICE: {"active": False, "current_prompt": False}}
        super().__init__(module, load_device=DEVICE, offload_device=torch.device("cpu"), size=size)
        self.name, self.resident, self.pinned_bytes = name, resident, pinned
        patchers.append(self)

    def is_dynamic(self):
        return True

    def loaded_size(self):
        return self.resident

    def loaded_ram_size(self):
        return self.pinned_bytes

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        self.model.device = device_to
        return None  # pages fault in while the model runs

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = min(self.resident, -(-int(memory_to_free + 1) // PAGE) * PAGE)
        self.resident -= freed
        events.append({"kind": "pages_freed", "model": self.name, "bytes": freed})
        return freed

    def detach(self, unpatch_all=True):
        if unpatch_all and (self.resident or self.pinned_bytes):
            events.append({"kind": "unloaded", "model": self.name, "vram": self.resident, "pinned": self.pinned_bytes})
            self.resident = self.pinned_bytes = 0
        return super().detach(unpatch_all=False)

    def partially_unload_ram(self, ram_to_unload, subsets=None):
        freed = min(self.pinned_bytes, int(ram_to_unload))
        self.pinned_bytes -= freed
        events.append({"kind": "pins_freed", "model": self.name, "bytes": freed})
        return freed

    def unregister_inactive_pins(self, ram_to_unload, subsets=None):
        return 0


class PlainModel(mp.ModelPatcher):
    # Another pack's plain patcher: its weights stay where they were loaded until ComfyUI unloads them.
    def __init__(self, name, size):
        super().__init__(type(name, (torch.nn.Module,), {})(), load_device=DEVICE,
                         offload_device=torch.device("cpu"), size=size)
        self.name, self.resident = name, 0
        patchers.append(self)

    def loaded_size(self):
        return self.resident

    def current_loaded_device(self):
        return DEVICE

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        self.resident = self.size
        return self.size

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = min(self.resident, int(memory_to_free) + 1)  # whole modules: at least what was asked
        self.resident -= freed
        events.append({"kind": "plain_unloaded", "model": self.name, "bytes": freed})
        return freed

    def detach(self, unpatch_all=True):
        if unpatch_all and self.resident:
            events.append({"kind": "plain_unloaded", "model": self.name, "bytes": self.resident})
            self.resident = 0
        return super().detach(unpatch_all=False)


class Pipeline:
    # What nodes/memory.py reads of a WanVACEModel; `activate` allocates as our residency does.
    def __init__(self):
        self.base, self.device, self.dtype = self, DEVICE, torch.bfloat16
        self.residency = types.SimpleNamespace(broker=None)
        self.held = 0

    def device_bytes(self):
        return self.held

    def release_device_memory(self):
        released, self.held = self.held, 0
        events.append({"kind": "ours_released", "bytes": released})
        return released

    def activate(self, nbytes):
        self.residency.broker.reserve(nbytes)
        self.held += nbytes
        missing = -free_bytes()
        for model in [p for p in patchers if isinstance(p, DynamicModel)]:  # lowest priority (oldest) first
            if missing <= 0:
                break
            taken = min(model.resident, -(-missing // PAGE) * PAGE)
            if taken:
                model.resident -= taken
                missing -= taken
                events.append({"kind": "paged_out_on_demand", "model": model.name, "bytes": taken})
        if free_bytes() < 0:
            events.append({"kind": "out_of_memory", "bytes": -free_bytes()})


def reset(dynamic_vram):
    mm.current_loaded_models.clear()
    patchers.clear()
    memory._brokers.clear()
    if HAS_DYNAMIC:
        import comfy.memory_management

        comfy.memory_management.aimdo_enabled = dynamic_vram


def step(name, action):
    events.clear()
    action()
    return {"step": name, "events": list(events), "free": free_bytes()}


def scenario(dynamic_vram):
    reset(dynamic_vram)
    # After a native Wan 2.2 prompt (two 14 GiB fp8 experts, umt5, VAE) on a 24 GiB card.
    native = {}
    for name, size, resident in [("UMT5", 6.7, 0), ("WanHigh", 14, 9), ("WanLow", 14, 14), ("WanVAE", 0.25, 0.25)]:
        native[name] = DynamicModel(name, int(size * GIB), int(resident * GIB), int(size * GIB))
        mm.load_models_gpu([native[name]])
    pipeline = Pipeline()
    steps = [step("register", lambda: patchers.append(memory.cooperate(pipeline, DEVICE)))]
    steps.append(step("expert", lambda: pipeline.activate(14 * GIB)))
    steps.append(step("vae", lambda: pipeline.activate(GIB // 4)))
    # The native workflow again: its first expert needs room while our pipeline holds its weights.
    steps.append(step("native_expert", lambda: mm.load_models_gpu([native["WanHigh"]])))
    return steps


def plain_model_unloaded_for_us(dynamic_vram):
    reset(dynamic_vram)
    if HAS_DYNAMIC:
        mm.load_models_gpu([DynamicModel("WanLow", 14 * GIB, GIB, 14 * GIB)])
    other = PlainModel("OtherPacksModel", 20 * GIB)
    mm.load_models_gpu([other])
    pipeline = Pipeline()
    patchers.append(memory.cooperate(pipeline, DEVICE))
    events.clear()
    pipeline.activate(6 * GIB)
    return {"events": list(events), "other_resident": other.resident, "free": free_bytes()}


def free_memory_asked(dynamic_vram):
    reset(dynamic_vram)
    page_reclaimable = 5 * GIB
    if HAS_DYNAMIC:
        import comfy_aimdo.model_vbar

        comfy_aimdo.model_vbar.vbars_analyze = lambda device=None: page_reclaimable
    unregistered = Pipeline()
    pipeline = Pipeline()
    patchers.append(memory.cooperate(pipeline, DEVICE))
    return {"module": free_bytes(), "registered": memory.free_device_memory(pipeline),
            "unregistered": memory.free_device_memory(unregistered), "reclaimable": page_reclaimable}


report = {"has_dynamic": HAS_DYNAMIC, "plain": {"scenario": scenario(False),
          "other": plain_model_unloaded_for_us(False), "free": free_memory_asked(False)}}
if HAS_DYNAMIC:
    report["dynamic"] = {"scenario": scenario(True), "other": plain_model_unloaded_for_us(True),
                         "free": free_memory_asked(True)}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    from tests.support.comfyui import require_comfyui

    comfy = require_comfyui("comfy/model_management.py")
    env = {**os.environ, "WANVACE_REPO": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=comfy, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


GIB = 1024**3
PAGE = 32 * 1024**2


def _kinds(step: dict) -> list[str]:
    return [event["kind"] for event in step["events"]]


def _steps(scenario: list[dict]) -> dict[str, dict]:
    return {step["step"]: step for step in scenario}


def _dynamic(report: dict) -> dict:
    if not report["has_dynamic"]:
        pytest.skip("this ComfyUI has no Dynamic VRAM (0.3.75): every reservation is a load_models_gpu there")
    return report["dynamic"]


def test_registration_takes_comfyuis_non_dynamic_path_once(report):
    """Our plain patcher enters ComfyUI's list of loaded models through load_models_gpu, which for any plain
    patcher evicts pages until its own estimate (1.19 GiB here) is free and unloads whole every dynamic model
    holding less VRAM than is still missing, its pinned host copy included (umt5: 0 bytes of VRAM freed,
    6.7 GiB of pinned RAM dropped). That is ComfyUI's rule for its own plain models too; we pay it once per
    registration, not at every reservation."""
    new = _steps(_dynamic(report)["scenario"])["register"]
    old = _steps(report["plain"]["scenario"])["register"]
    assert new["events"] == old["events"]
    assert {"kind": "unloaded", "model": "UMT5", "vram": 0, "pinned": int(6.7 * GIB)} in new["events"]


def test_reservations_leave_dynamic_models_paging_out_on_demand(report):
    """After registration, an expert (14 GiB) and the VAE moving onto the device unload no dynamic model and drop
    no pinned copy: their pages give way only for the bytes that do not fit, as comfy-aimdo does for any CUDA
    allocation. Before, each reservation was a load_models_gpu: it unloaded the high-noise expert whole (8.5 GiB
    of VRAM, 14 GiB pinned) and the VAE, and freed 6.6 GiB of the low-noise expert's pages ahead of need."""
    steps = _steps(_dynamic(report)["scenario"])
    allocated = 14 * GIB + GIB // 4
    paged_out = 0
    for name in ("expert", "vae"):
        assert set(_kinds(steps[name])) <= {"paged_out_on_demand"}, steps[name]
        assert steps[name]["free"] >= 0, steps[name]
        paged_out += sum(event["bytes"] for event in steps[name]["events"])
    assert allocated - steps["register"]["free"] <= paged_out <= allocated - steps["register"]["free"] + 2 * PAGE

    old = _steps(report["plain"]["scenario"])
    unloaded = [event for event in old["expert"]["events"] if event["kind"] == "unloaded"]
    assert [event["model"] for event in unloaded] == ["WanHigh", "WanVAE"]
    assert sum(event["pinned"] for event in unloaded) == 14 * GIB + GIB // 4


def test_a_dynamic_model_that_needs_room_unloads_our_weights(report):
    """ComfyUI's own next load (the native high-noise expert) makes our pipeline release its device weights, as
    it does any plain model's; ours go whole (our units are whole components) where a ComfyUI plain model would
    offload only what is missing."""
    for mode in ("dynamic", "plain"):
        if mode not in report:
            continue
        step = _steps(report[mode]["scenario"])["native_expert"]
        assert {"kind": "ours_released", "bytes": 14 * GIB + GIB // 4} in step["events"], (mode, step)


def test_plain_models_of_other_packs_are_unloaded_for_our_weights(report):
    """A 20 GiB plain model of another pack beside a dynamic model holding 1 GiB: our 6 GiB reservation still has
    ComfyUI unload what the free memory and the dynamic pages cannot cover (3.2 GiB of the plain model), and the
    dynamic model keeps its pinned copy (before, it was unloaded whole, 14 GiB of pinned RAM)."""
    old = report["plain"]["other"]
    assert any(event["kind"] == "plain_unloaded" for event in old["events"]), old
    if not report["has_dynamic"]:
        return
    new = report["dynamic"]["other"]
    assert _kinds(new) == ["plain_unloaded"], new
    assert new["free"] >= 0
    assert {"kind": "unloaded", "model": "WanLow", "vram": int(0.78125 * GIB), "pinned": 14 * GIB} in old["events"]


def test_batching_and_tiles_count_what_dynamic_models_give_back(report):
    """`free_device_memory` asks our patcher, as ComfyUI tells model code to: under Dynamic VRAM the VRAM idle
    dynamic models hold (5 GiB here, comfy-aimdo's `vbars_analyze`) counts as free; without it (or in 0.3.75,
    whose patcher has no `get_free_memory`), and for a pipeline ComfyUI does not manage, it is ComfyUI's
    module-level figure."""
    plain = report["plain"]["free"]
    assert plain["registered"] == plain["unregistered"] == plain["module"]
    if report["has_dynamic"]:
        dynamic = report["dynamic"]["free"]
        assert dynamic["registered"] == dynamic["module"] + dynamic["reclaimable"]
        assert dynamic["unregistered"] == dynamic["module"]
