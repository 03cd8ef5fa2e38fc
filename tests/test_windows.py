"""Context-window schedules, fuse weights and FreeNoise (wanvace_core/generation/windows.py) against ComfyUI's own
`comfy.context_windows`, run in a subprocess in the set's ComfyUI tree as the oracle (nothing of it is copied).

    python tests/test_windows.py CASES_JSON OUT_FILE    # (in a ComfyUI tree) ComfyUI's answers for the cases
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
COMFY_DIR = Path(os.environ.get("WANVACE_COMFY_DIR", REPO / ".cache" / "comfyui-current"))

# Latent frames of the video; window length and overlap in latent frames; steps 0-5 move the uniform schedules.
FRAMES = (3, 5, 9, 13, 21, 22, 31, 41, 61)
LENGTHS_AND_OVERLAPS = ((2, 0), (5, 0), (5, 1), (5, 3), (9, 2), (13, 4), (21, 4), (21, 7))
SCHEDULES = ("standard_static", "standard_uniform", "looped_uniform")
STRIDES = (1, 2, 3)
STEPS = range(6)
FREENOISE_SHAPE = (1, 2, 61, 2, 3)


def _cases() -> list[dict]:
    cases = []
    for frames, (length, overlap), schedule in itertools.product(FRAMES, LENGTHS_AND_OVERLAPS, SCHEDULES):
        strides = (1,) if schedule == "standard_static" else STRIDES
        loops = (False, True) if schedule == "looped_uniform" else (False,)
        steps = (0,) if schedule == "standard_static" else STEPS
        for stride, closed_loop, step in itertools.product(strides, loops, steps):
            cases.append(
                {
                    "frames": frames,
                    "length": length,
                    "overlap": overlap,
                    "schedule": schedule,
                    "stride": stride,
                    "closed_loop": closed_loop,
                    "step": step,
                }
            )
    return cases


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


def _comfy_answers(cases: list[dict], out_file: str) -> None:
    sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.context_windows as windows

    answers = []
    for case in cases:
        handler = SimpleNamespace(
            context_length=case["length"],
            context_overlap=case["overlap"],
            context_stride=case["stride"],
            closed_loop=case["closed_loop"],
            _step=case["step"],
        )
        schedule = windows.get_matching_context_schedule(case["schedule"])
        found = schedule.func(case["frames"], handler, {})
        weights = {}
        for method in ("pyramid", "flat", "overlap-linear"):
            if method == "overlap-linear" and case["overlap"] == 0:
                continue  # ComfyUI fails on it (windows.py ramps nothing there)
            fuse = windows.get_matching_fuse_method(method)
            weights[method] = [
                [
                    float(w)
                    for w in fuse.func(
                        len(window),
                        full_length=case["frames"],
                        idxs=window,
                        handler=handler,
                        context_overlap=case["overlap"],
                    )
                ]
                for window in found
            ]
        answers.append(
            {"windows": found, "missing": windows.get_missing_indexes(found, case["frames"]), "weights": weights}
        )
    noise = {}
    for length, overlap in LENGTHS_AND_OVERLAPS if hasattr(windows, "apply_freenoise") else ():  # not in 0.3.75
        start = torch.randn(FREENOISE_SHAPE, generator=torch.Generator().manual_seed(3))
        noise[f"{length},{overlap}"] = windows.apply_freenoise(start, 2, length, overlap, seed=42)
    torch.save({"answers": answers, "freenoise": noise}, out_file)


# --- the pytest side -------------------------------------------------------------------------------------

from tests.support.vace_tasks import HEIGHT, LONG, WIDTH, long_inputs  # noqa: E402
from wanvace_core import (  # noqa: E402
    OffloadOptions,
    SamplerSettings,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.generation.guidance import Guidance  # noqa: E402
from wanvace_core.generation.windows import (  # noqa: E402
    ContextWindowOptions,
    check_windows,
    freenoise,
    plan_windows,
    window_frames,
    window_weights,
    windowed_prediction,
)


def _options(length: int, overlap: int, **fields) -> ContextWindowOptions:
    """Options in video frames for a window of `length` latent frames overlapping by `overlap`."""
    return ContextWindowOptions(context_length=4 * (length - 1) + 1, context_overlap=4 * overlap, **fields)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    if not (COMFY_DIR / "comfy" / "context_windows.py").is_file():
        pytest.skip(f"no ComfyUI tree with comfy/context_windows.py at {COMFY_DIR}")
    cases = _cases()
    folder = tmp_path_factory.mktemp("windows")
    (folder / "cases.json").write_text(json.dumps(cases))
    out = folder / "comfy.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(Path(__file__).resolve()), str(folder / "cases.json"), str(out)]
    done = subprocess.run(command, cwd=COMFY_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"ComfyUI's context windows failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return cases, torch.load(out, weights_only=True)


def test_window_lists_and_weights_equal_comfyuis(comfy):
    cases, answers = comfy
    compared = refused = 0
    for case, answer in zip(cases, answers["answers"], strict=True):
        options = _options(
            case["length"],
            case["overlap"],
            schedule=case["schedule"],
            context_stride=case["stride"],
            closed_loop=case["closed_loop"],
        )
        if answer["missing"]:
            # Settings that leave frames in no window are refused, naming them.
            with pytest.raises(WanVACEInputError, match="in no window"):
                window_frames(options, case["frames"], case["step"])
            refused += 1
            continue
        ours = window_frames(options, case["frames"], case["step"])
        if case["schedule"] == "looped_uniform" and case["frames"] == case["length"]:
            # One window, not rotated (windows.py's deliberate differences).
            assert ours == [list(range(case["frames"]))], case
            continue
        assert ours == answer["windows"], case
        for method, theirs in answer["weights"].items():
            weighted = ContextWindowOptions(**{**options.__dict__, "fuse_method": method})
            got = [window_weights(weighted, window, case["frames"]).tolist() for window in ours]
            assert got == theirs, (case, method)
        compared += 1
    assert compared > 2000 and refused < compared / 10, (compared, refused)


def test_freenoise_equals_comfyuis(comfy):
    _cases, answers = comfy
    if not answers["freenoise"]:
        pytest.skip(f"the ComfyUI at {COMFY_DIR} has no FreeNoise (0.3.75 has none)")
    for key, theirs in answers["freenoise"].items():
        length, overlap = map(int, key.split(","))
        start = torch.randn(FREENOISE_SHAPE, generator=torch.Generator().manual_seed(3))
        ours = freenoise(start.clone(), _options(length, overlap), seed=42)
        assert torch.equal(ours, theirs), key
        assert length >= FREENOISE_SHAPE[2] or not torch.equal(ours, start), f"{key}: nothing was shuffled"


@pytest.mark.parametrize("fuse_method", ["pyramid", "flat", "overlap-linear"])
@pytest.mark.parametrize("schedule", ["standard_static", "standard_uniform", "looped_uniform"])
def test_each_frames_shares_sum_to_one(schedule, fuse_method):
    for frames, (length, overlap), step in itertools.product((21, 31, 61), ((5, 1), (9, 2), (21, 4)), range(4)):
        options = _options(length, overlap, schedule=schedule, fuse_method=fuse_method)
        totals = torch.zeros(frames, dtype=torch.float64)
        for window in plan_windows(options, frames, step):
            totals.index_add_(0, torch.tensor(window.frames), window.shares.double())
        assert torch.allclose(totals, torch.ones(frames, dtype=torch.float64), rtol=0, atol=1e-6), (frames, step)


@pytest.mark.parametrize("fuse_method", ["pyramid", "flat", "overlap-linear"])
def test_a_window_over_the_whole_video_takes_all_of_each_frame(fuse_method):
    options = ContextWindowOptions(context_length=81, context_overlap=16, fuse_method=fuse_method)
    for frames in (5, 21):
        (window,) = plan_windows(options, frames, step=3)
        assert window.frames == tuple(range(frames))
        assert torch.equal(window.shares, torch.ones(frames))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"context_length": 80}, "context_length=80 must be 4n\\+1"),
        ({"context_length": 1}, "context_length=1 must be 4n\\+1 video frames and at least 5"),
        ({"context_overlap": 30}, "context_overlap=30 must be a multiple of 4"),
        ({"context_overlap": -4}, "context_overlap=-4 must be a multiple of 4"),
        ({"context_length": 17, "context_overlap": 16}, "context_overlap=16 must be less than context_length - 1"),
        ({"context_stride": 0}, "context_stride=0 must be 1 or more"),
        ({"schedule": "batched"}, "schedule='batched' is unknown"),
        ({"fuse_method": "relative"}, "fuse_method='relative' is unknown"),
        ({"context_length": 81.0}, "context_length=81.0 is not an integer"),
    ],
)
def test_bad_settings_are_refused_naming_the_input(fields, fragment):
    with pytest.raises(WanVACEInputError, match=fragment):
        ContextWindowOptions(**fields)


def test_settings_that_leave_a_frame_out_at_some_step_are_refused_before_sampling():
    options = _options(9, 2, schedule="standard_uniform", context_stride=2)
    check_windows(options, 21, steps=2)  # steps 0 and 1 cover every frame
    with pytest.raises(
        WanVACEInputError,
        match=r"leave latent frames \[1, 3\] of 21 in no window at step 2; use "
        "context_stride 1",
    ):
        check_windows(options, 21, steps=8)


def test_latent_sizes_follow_the_vae():
    options = ContextWindowOptions(context_length=81, context_overlap=16)
    assert (options.latent_length, options.latent_overlap) == (21, 4)


# --- through the sampler -----------------------------------------------------------------------------------

SETTINGS = SamplerSettings(seed=7, steps=3, cfg=5.0, cfg_low_noise=4.0)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


@pytest.mark.parametrize("task", ["t2v", "r2v", "inpaint"])
def test_a_window_over_the_whole_video_samples_bitwise_as_without_windows(model, task):
    cond = prepare_conditioning(model, long_inputs(task))
    plain = sample(model, cond, SETTINGS).latents
    for schedule in ("standard_static", "standard_uniform", "looped_uniform"):
        options = ContextWindowOptions(context_length=LONG, context_overlap=8, schedule=schedule, freenoise=True)
        assert torch.equal(sample(model, cond, SETTINGS, windows=options).latents, plain), schedule


@pytest.mark.parametrize("task", ["r2v", "inpaint"])
def test_each_window_gets_its_slice_of_the_vace_context_and_the_references(model, task):
    cond = prepare_conditioning(model, long_inputs(task))
    references = cond.num_reference_images
    options = ContextWindowOptions(context_length=17, context_overlap=8, freenoise=False)
    seen = []
    original = model.transformer.forward

    def recording(*args, **kwargs):
        seen.append({name: kwargs[name].clone() for name in ("hidden_states", "control_hidden_states")})
        return original(*args, **kwargs)

    model.transformer.forward = recording
    try:
        windowed = sample(
            model,
            cond,
            SamplerSettings(seed=7, steps=1, cfg=1.0, cfg_low_noise=1.0, boundary_ratio=0.0),
            windows=options,
        ).latents
    finally:
        del model.transformer.forward
    planned = plan_windows(options, cond.conditioning_latents.shape[2] - references, 0)
    assert len(planned) == 3 and len(seen) == 3
    full = cond.conditioning_latents
    for window, inputs in zip(planned, seen, strict=True):
        frames = [references + index for index in window.frames]
        # The reference frames lead every window's VACE context, and the rest is the full context's slice (control
        # latents, inactive and reactive, and the mask latents alike: one tensor, sliced in time).
        assert torch.equal(inputs["control_hidden_states"][:, :, :references], full[:, :, :references])
        assert torch.equal(inputs["control_hidden_states"][:, :, references:], full[:, :, frames])
        assert inputs["hidden_states"].shape[2] == references + len(frames)
    assert windowed.shape[2] == full.shape[2] - references


def test_each_windows_prediction_is_the_forward_on_its_slice_alone(model):
    cond = prepare_conditioning(model, long_inputs("r2v"))
    references = cond.num_reference_images
    options = ContextWindowOptions(context_length=17, context_overlap=8)
    frames = cond.conditioning_latents.shape[2]
    latents = torch.randn(1, 16, frames, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(1))
    inputs = {
        "hidden_states": latents,
        "timestep": torch.tensor([500]),
        "control_hidden_states": cond.conditioning_latents,
        "control_hidden_states_scale": cond.conditioning_scale,
        "return_dict": False,
    }
    guidance = Guidance()
    returned = []

    def predict(sliced):
        returned.append(guidance.predict(model.transformer, 5.0, cond, sliced))
        return returned[-1]

    windows = plan_windows(options, frames - references, 0)
    fused = windowed_prediction(predict, inputs, windows, references)
    fused_by_hand = torch.zeros_like(fused)
    for window, prediction in zip(windows, returned, strict=True):
        # The window on its own: the references, then its frames, cut from the full inputs by plain slicing.
        first, last = references + window.frames[0], references + window.frames[-1] + 1
        alone = {
            **inputs,
            "hidden_states": torch.cat([latents[:, :, :references], latents[:, :, first:last]], dim=2),
            "control_hidden_states": torch.cat(
                [cond.conditioning_latents[:, :, :references], cond.conditioning_latents[:, :, first:last]], dim=2
            ),
        }
        assert torch.equal(prediction, guidance.predict(model.transformer, 5.0, cond, alone))
        fused_by_hand[:, :, first:last] += prediction[:, :, references:] * window.shares.view(1, 1, -1, 1, 1)
        fused_by_hand[:, :, :references] += prediction[:, :, :references] / len(windows)
    assert torch.allclose(fused, fused_by_hand, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_windows_under_offload_equal_them_on_the_device_bitwise(model, tiny_folder, mode):
    cond = prepare_conditioning(model, long_inputs("inpaint"))
    options = ContextWindowOptions(context_length=17, context_overlap=8)
    expected = sample(model, cond, SETTINGS, windows=options).latents
    offloaded = load_pipeline(tiny_folder, "fp32", offload=OffloadOptions(mode=mode))
    assert torch.equal(sample(offloaded, cond, SETTINGS, windows=options).latents, expected)


def test_a_cancel_stops_between_windows_and_the_next_run_is_unchanged(model):
    cond = prepare_conditioning(model, long_inputs("t2v"))
    options = ContextWindowOptions(context_length=17, context_overlap=8)
    expected = sample(model, cond, SETTINGS, windows=options).latents
    windows_started = []

    class Cancelled(Exception):
        pass

    def cancel_at_the_second_window():
        windows_started.append(None)
        if len(windows_started) == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        sample(model, cond, SETTINGS, windows=options, between_windows=cancel_at_the_second_window)
    assert len(windows_started) == 2
    assert torch.equal(sample(model, cond, SETTINGS, windows=options).latents, expected)


if __name__ == "__main__":
    _comfy_answers(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
