"""wanvace_core/budget.py's peak estimates against the peaks measured on the CPU, each case in a fresh process.

Each case runs the call whose estimate a node tells ComfyUI as `memory_required`: `sample` for WanVACESampler
(`sampling_activation_bytes`), `decode` for WanVACEDecode and `prepare_conditioning` for WanVACEConditioning's
control-video encode (the four `vae_*_peak_bytes`, untiled and tiled). The VAE is the real Wan 2.1 architecture
(`AutoencoderKLWan()`'s default config, random weights, the shape the estimates were fitted on) in a tiny pipeline;
the sampler's experts are small `WanVACETransformer3DModel`s with the real head size and FFN ratio. fp32, 2 threads.

One subprocess imports torch and diffusers once, then forks a process per case before any tensor work, so each
case starts with nothing computed (no oneDNN state, no library code paged in by an earlier case) without paying
for the imports five times (CI's 2 cores). Measured: the private (anonymous) memory the call adds at its peak above
the process just before it, with an allocator that returns every freed block of 64 KiB or more to the system
(MALLOC_MMAP_THRESHOLD_) so resident memory follows live tensors: the larger of the kernel's exact VmHWM minus the
file-backed pages the call faulted in (library code run for the first time, no device memory) and RssAnon polled
every millisecond (bench/rss.py). The two agreed within 1.5 MiB in every case measured.

    .venvs/current/bin/python tests/test_budget.py TINY_FOLDER [CASE ...]   # the figures as JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20

# 4096 tokens: at 2048, the first call's one-time oneDNN state (~4 MiB) and RoPE's per-head tables are 10% of the peak.
SAMPLE_SIZE = (13, 512, 512)  # video frames, height, width: 4 latent frames of 32 x 32 patches, 4096 tokens
# The VAE cases: 2 latent frames (5 video frames: the first frame, then one 4-frame chunk) at 64 x 128 pixels, where
# the per-pixel part is most of each estimate. Each VAE call costs the CPU about 1 s whatever the frame size (16 x 16
# takes half as long as 64 x 64), so the tiled cases use the fewest tiles that still blend: one row of 2 tiles (9 and
# 8 latent pixels wide, overlapping 1).
VAE_SIZE = (5, 64, 128)
TILE_SIZE, TILE_OVERLAP = 72, 8
CASES = ("sampling", "decode", "decode_tiled", "encode", "encode_tiled")

# estimate / measured must lie in [LOWEST, HIGHEST]. LOWEST: ComfyUI frees `memory_required` plus its own reserve
# before the call, so a small shortfall is absorbed; 10% is the most allowed. The CPU peak also holds work a GPU
# does not (oneDNN weight reorders and scratch), so it over-states, never under-states, the device's need.
# HIGHEST: at these sizes the VAE estimates' fixed 64 MiB (fitted with the library code pages, which this test
# leaves out) is 29-53% of the estimate; measured (both sets): decode 1.23-1.24, tiled decode 1.44-1.46, encode
# 0.97, tiled encode 1.20. 1.75 still fails a doubled estimate in every case (a doubled encode, 1.94, included),
# and LOWEST a halved one (a halved tiled decode, 0.73, included).
LOWEST, HIGHEST = 0.9, 1.75


def _child_env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }


@pytest.fixture(scope="module")
def measured(tiny_folder) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), str(tiny_folder), *CASES]
    done = subprocess.run(command, env=_child_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.one_set
@pytest.mark.parametrize("case", CASES)
def test_estimate_is_near_the_measured_peak(case, measured):
    result = measured[case]
    ratio = result["estimate"] / result["measured"]
    print(
        f"{case}: estimate {result['estimate'] / MIB:.1f} MiB / measured {result['measured'] / MIB:.1f} MiB = "
        f"{ratio:.2f} (sampled private {result['sampled_private'] / MIB:.1f}, VmHWM minus file-backed "
        f"{result['hwm_minus_file'] / MIB:.1f}, {result['file_faulted'] / MIB:.1f} MiB of library code paged in; "
        f"{result['seconds']:.1f} s)"
    )
    assert ratio >= LOWEST, f"{case}: the estimate is {1 - ratio:.0%} below the measured peak"
    assert ratio <= HIGHEST, f"{case}: the estimate is {ratio:.2f}x the measured peak"


@pytest.mark.slow
@pytest.mark.one_set
@pytest.mark.parametrize("direction", ["decode", "encode"])
def test_tiled_cases_ran_tiled(direction, measured):
    """A tiled case that silently ran untiled would measure the untiled peak against the tiled estimate."""
    untiled, tiled = measured[direction], measured[f"{direction}_tiled"]
    assert untiled["vae_calls"] > 0
    assert tiled["vae_calls"] == 2 * untiled["vae_calls"]  # 2 tiles
    assert tiled["shape"] == untiled["shape"]


# --- the child ------------------------------------------------------------------------------------------------


def _measure(case: str, folder: str) -> dict:
    import ctypes
    import dataclasses
    import gc
    import time

    import torch
    from diffusers import AutoencoderKLWan

    from bench.rss import PeakSampler, read_status, sampler_experts
    from wanvace_core import SamplerSettings, VACEInputs, decode, load_pipeline, prepare_conditioning, sample
    from wanvace_core.generation import budget
    from wanvace_core.generation.tiling import VAETiling
    from wanvace_core.runtime.plan import RuntimePlan, apply_plan

    torch.set_num_threads(2)
    model = load_pipeline(folder, "fp32")
    tiled = case.endswith("_tiled")
    tiling = VAETiling(mode="on" if tiled else "off", tile_size=TILE_SIZE, overlap=TILE_OVERLAP)
    frames, height, width = SAMPLE_SIZE if case == "sampling" else VAE_SIZE
    generator = torch.Generator().manual_seed(1)
    if case == "sampling":
        model.transformer, model.transformer_2 = sampler_experts(model)
    else:
        torch.manual_seed(0)
        model.vae = AutoencoderKLWan().eval().requires_grad_(False)
    model._helper = None  # the diffusers helper is rebuilt over the new components
    apply_plan(model, RuntimePlan())  # the interleaved forward and the residency, as load_pipeline sets them up
    coarse = torch.rand(3, frames, 8, 8, generator=generator)
    clip = torch.nn.functional.interpolate(coarse[None], size=(frames, height, width), mode="trilinear")[0]
    inputs = VACEInputs(
        "a bird flies over the sea", "blurry", width, height, frames, control_video=clip.permute(1, 2, 3, 0)
    )
    if case == "sampling":
        # The tiny VAE's encode of a whole clip takes seconds on the CPU and is not what is measured here: the
        # conditioning is prepared at 16 x 16 and its control latents redrawn at the run's size.
        small = prepare_conditioning(model, dataclasses.replace(inputs, width=16, height=16, control_video=None))
        shape = (*small.conditioning_latents.shape[:3], height // 8, width // 8)
        control = torch.randn(shape, generator=generator, dtype=small.conditioning_latents.dtype)
        cond = dataclasses.replace(small, conditioning_latents=control, width=width, height=height)
        # As WanVACESampler asks: the conditioning's latent frames at its pixel size.
        estimate = budget.sampling_activation_bytes(model, cond.conditioning_latents.shape[2], height, width)
        settings = SamplerSettings(seed=0, steps=1, cfg=1.0, cfg_low_noise=1.0)

        def run():
            return sample(model, cond, settings).latents

    elif case.startswith("decode"):
        latent_frames = 1 + (frames - 1) // 4
        latents = torch.randn(1, 16, latent_frames, height // 8, width // 8, generator=generator)
        if tiled:
            estimate = budget.vae_tiled_decode_peak_bytes(model, latent_frames, height, width, TILE_SIZE, TILE_OVERLAP)
        else:
            estimate = budget.vae_decode_peak_bytes(model, latent_frames, height, width)

        def run():
            return decode(model, latents, tiling)

    else:
        for text in (inputs.positive, inputs.negative):
            model.encode_prompt(text)  # cached now: the text encoder is no part of the VAE's estimate
        if tiled:
            estimate = budget.vae_tiled_encode_peak_bytes(model, frames, height, width, TILE_SIZE, TILE_OVERLAP)
        else:
            estimate = budget.vae_encode_peak_bytes(model, frames, height, width)

        def run():
            return prepare_conditioning(model, inputs, tiling).conditioning_latents

    calls = []
    coder = model.vae.encoder if case.startswith("encode") else model.vae.decoder
    coder.register_forward_hook(lambda *_: calls.append(None))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with PeakSampler() as peak:
        start = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - start
    file_faulted = read_status()["RssFile"] - peak.baseline["RssFile"]
    return {
        "estimate": estimate,
        "measured": max(peak.private_above_baseline, peak.total_above_baseline - file_faulted),
        "sampled_private": peak.private_above_baseline,
        "hwm_minus_file": peak.total_above_baseline - file_faulted,
        "file_faulted": file_faulted,
        "hwm_reset": peak.hwm_reset,
        "seconds": seconds,
        "vae_calls": len(calls),
        "shape": list(result.shape),
    }


def _main(folder: str, cases: list[str]) -> None:
    # Imported here, before any fork, so no case pays for them; nothing may compute before the forks (OpenMP's
    # thread pool does not survive a fork).
    import diffusers  # noqa: F401
    import torch  # noqa: F401

    import wanvace_core  # noqa: F401
    from bench.rss import run_forked
    from wanvace_core.generation import tiling  # noqa: F401
    from wanvace_core.runtime import plan  # noqa: F401

    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {CASES}")
    results = {case: run_forked(_measure, case, folder) for case in cases or CASES}
    print(json.dumps(results))
    failed = [case for case, result in results.items() if result is None]
    if failed:
        raise SystemExit(f"cases {failed} failed (tracebacks above)")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _main(sys.argv[1], sys.argv[2:])
