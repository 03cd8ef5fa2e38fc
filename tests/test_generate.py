"""The offline command `python -m wanvace_core.generate` on the tiny model: the recipe's flags, an MP4 of the asked
size and length, the VACE modes' inputs, its refusals (naming the flag), and the options it passes on.
(tests/integration/test_generate_server.py shows each mode equal to the shipped workflow through ComfyUI.)"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file, save_file

from wanvace_core import generate
from wanvace_core.generation.tasks import EMPTY_IMAGE_GREY, Outpaint, task_inputs

REPO = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 64, 48


def _png(path: Path, width: int = WIDTH, height: int = HEIGHT, seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return path


def _frames_of(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _flags(tiny_folder, output: Path, *extra: str, frames: int = 9, steps: int = 2) -> list[str]:
    return [
        "--model",
        str(tiny_folder),
        "--prompt",
        "a bird flies over the sea",
        "--height",
        str(HEIGHT),
        "--width",
        str(WIDTH),
        "--num-frames",
        str(frames),
        "--num-inference-steps",
        str(steps),
        "--seed",
        "42",
        "--device",
        "cpu",
        "--output",
        str(output),
        *extra,
    ]


def test_the_recipe_command_writes_an_mp4_of_the_asked_size_and_length_with_progress(tiny_folder, tmp_path):
    output = tmp_path / "out.mp4"
    recipe = ["--guidance-scale", "5.0", "--vae-use-tiling", "--dtype", "fp32"]
    command = [sys.executable, "-m", "wanvace_core.generate", *_flags(tiny_folder, output, *recipe)]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {output}" in done.stdout
    assert "denoising: 100%" in done.stderr and "2/2" in done.stderr
    frames = _frames_of(output)
    assert frames.shape == (9, HEIGHT, WIDTH, 3)
    assert frames.std() > 0, "a video of one flat colour"


def test_the_guidance_flags_map_to_the_stages_as_the_recipe_has_them(tiny_folder, tmp_path):
    parser = generate.build_parser()
    both = parser.parse_args(_flags(tiny_folder, tmp_path / "o.mp4", "--guidance-scale", "4.0"))
    _, settings = generate.job_from_args(both)
    assert (settings.cfg, settings.cfg_low_noise) == (4.0, 4.0)
    split = parser.parse_args(
        _flags(tiny_folder, tmp_path / "o.mp4", "--guidance-scale", "4.0", "--guidance-scale-2", "3.0")
    )
    _, settings = generate.job_from_args(split)
    # --guidance-scale is the low-noise stage's, --guidance-scale-2 the high-noise stage's.
    assert (settings.cfg, settings.cfg_low_noise) == (3.0, 4.0)
    shifted = parser.parse_args(
        _flags(tiny_folder, tmp_path / "o.mp4", "--flow-shift", "5.0", "--boundary-ratio", "0.9")
    )
    _, settings = generate.job_from_args(shifted)
    assert (settings.shift, settings.boundary_ratio) == (5.0, 0.9)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--num-frames", "10"], "--num-frames=10 frames is not of the form 4n+1"),
        (["--width", "70"], "--width=70 is not a positive multiple of 16; use 64"),
        (["--width", "832", "--height", "480", "--num-frames", "81"], "--width=832 is more than this model can run"),
        (["--num-frames", "161"], "--num-frames=161 gives 41 latent frames per transformer call"),
        (["--num-frames", "241", "--context-length", "161"], "--context-length=161 gives 41 latent frames per window"),
        (["--mode", "i2v"], "--mode i2v needs --image"),
        (["--mode", "t2v", "--image", "IMAGE"], "--mode t2v does not use --image"),
        (["--mode", "i2v", "--image", "MISSING"], "--image"),
        (
            ["--mode", "outpaint", "--video", "VIDEO"],
            "--mode outpaint pads no side; give at least one of --outpaint-left",
        ),
        (["--prompt", " "], "--prompt is empty"),
        (["--strength", "nan"], "--strength=nan is not a finite number"),
        (["--guidance-scale", "nan"], "--guidance-scale=nan is not a finite number"),
        (["--guidance-scale-2", "0.5"], "--guidance-scale-2=0.5 is below 1.0"),
        (["--num-inference-steps", "0"], "--num-inference-steps=0 must be at least 1"),
        (["--seed", "-1"], "--seed=-1 must lie in [0, 2**64)"),
        (["--boundary-ratio", "1.5"], "--boundary-ratio=1.5 must lie in [0, 1]"),
        (["--flow-shift", "100", "--num-inference-steps", "20"], "--flow-shift=100.0 with --num-inference-steps=20"),
        (["--fps", "0"], "--fps 0.0 must be a positive number"),
        (["--cache", "DBCache", "--cache-threshold", "nan"], "--cache-threshold=nan is not a finite number"),
        (["--context-length", "10"], "--context-length=10 must be 4n+1"),
        (["--context-length", "17", "--context-overlap", "6"], "--context-overlap=6 must be a multiple of 4"),
        (["--lora", "MISSING"], "--lora "),
        (["--lora", "IMAGE"], "--lora "),
        (["--lora", "LORA:nan"], "--lora=nan"),
        (["--parallel-devices", "cuda:0,cuda:1"], "--parallel-devices: devices names cuda:0, cuda:1"),
        (["--parallel-devices", "cpu,cpu", "--ulysses-degree", "3"], "--ulysses-degree=3 must divide"),
        (["--parallel-devices", "cpu,cpu", "--lora", "LORA"], "--lora does not run yet with --parallel-devices"),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--device", "tpu"], "--device 'tpu' is not a device name"),
    ],
)
def test_bad_flags_are_refused_in_one_line_naming_them_before_the_model_loads(
    tiny_folder, tmp_path, capsys, monkeypatch, extra, fragment
):
    image = _png(tmp_path / "image.png")
    video = tmp_path / "video.mov"
    generate.write_mp4(str(video), torch.rand(5, HEIGHT, WIDTH, 3), 16.0)
    lora = tmp_path / "style.safetensors"
    save_file({"lora_unet_blocks_0_attn1_to_q.lora_down.weight": torch.zeros(4, 16)}, str(lora))
    replaced = [
        {"IMAGE": str(image), "VIDEO": str(video), "MISSING": str(tmp_path / "missing.png"), "LORA": str(lora)}.get(
            flag, flag.replace("LORA", str(lora))
        )
        for flag in extra
    ]
    loaded = []
    monkeypatch.setattr(generate, "load_pipeline", lambda *args, **kwargs: loaded.append(args))
    flags = _flags(tiny_folder, tmp_path / "o.mp4")
    # Later flags win in argparse, so the case's flags override the defaults.
    assert generate.main([*flags, *replaced]) == 2
    error = capsys.readouterr().err
    lines = error.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --"), error
    assert fragment in error, error
    assert loaded == [], "refused after the model loaded"
    assert not (tmp_path / "o.mp4").exists()


def test_an_unknown_model_folder_is_refused_naming_it(tmp_path, capsys):
    flags = _flags(tmp_path / "no-such-model", tmp_path / "o.mp4")
    assert generate.main(flags) == 2
    assert str(tmp_path / "no-such-model") in capsys.readouterr().err


def test_cache_windows_and_lora_flags_reach_the_run(tiny_folder, tmp_path, capsys):
    from tests.support.lora_files import lora_content, write_lora
    from wanvace_core import load_pipeline

    lora = write_lora(
        tmp_path / "style.safetensors", lora_content(load_pipeline(tiny_folder, "fp32"), rank=4, seed=1), "lightx2v"
    )
    plain, styled = tmp_path / "plain.latent", tmp_path / "styled.latent"
    common = ["--dtype", "fp32", "--context-length", "17", "--context-overlap", "8", "--cache", "DBCache"]
    assert (
        generate.main([*_flags(tiny_folder, tmp_path / "p.mp4", *common, "--save-latent", str(plain), frames=33)]) == 0
    )
    report = capsys.readouterr().err
    assert "Cache-DiT DBCache" in report and "(3 windows)" in report, report
    with_lora = [*common, "--lora", f"{lora}:0.8", "--save-latent", str(styled)]
    assert generate.main(_flags(tiny_folder, tmp_path / "s.mp4", *with_lora, frames=33)) == 0
    plain_latents, styled_latents = load_file(str(plain))["latent_tensor"], load_file(str(styled))["latent_tensor"]
    assert plain_latents.shape[2] == 9 and not torch.equal(plain_latents, styled_latents)
    assert _frames_of(tmp_path / "s.mp4").shape[0] == 33


def test_lora_specs_take_an_optional_strength_and_keep_colons_in_paths():
    patches = generate._loras(["a.safetensors", "b.safetensors:0.5", "C:\\loras\\c.safetensors", "d.safetensors:-1"])
    assert [(str(p.path), p.strength_high_noise) for p in patches] == [
        ("a.safetensors", 1.0),
        ("b.safetensors", 0.5),
        ("C:\\loras\\c.safetensors", 1.0),
        ("d.safetensors", -1.0),
    ]


# --- the modes' inputs ----------------------------------------------------------------------------------------


def test_first_and_last_frame_fill_between_with_comfyuis_empty_image_grey_and_mask_it():
    first, last = torch.rand(1, HEIGHT, WIDTH, 3), torch.rand(1, HEIGHT, WIDTH, 3)
    fields = task_inputs("flf2v", WIDTH, HEIGHT, 9, image=first, last_image=last)
    video, masks = fields["control_video"], fields["control_masks"]
    assert torch.equal(video[0], first[0]) and torch.equal(video[-1], last[0])
    assert torch.all(video[1:-1] == EMPTY_IMAGE_GREY)
    assert masks[:, 0, 0].tolist() == [0.0] + [1.0] * 7 + [0.0]


def test_outpaint_places_the_source_inside_grey_padding_masked_to_generate():
    source = torch.rand(3, HEIGHT, 32, 3)
    fields = task_inputs("outpaint", WIDTH, HEIGHT, 9, video=source, outpaint=Outpaint(left=16, right=16))
    assert torch.equal(fields["control_video"][:, :, 16:48], source)
    assert torch.all(fields["control_video"][:, :, :16] == 0.5)
    assert torch.all(fields["control_masks"][:, :, 16:48] == 0) and torch.all(fields["control_masks"][:, :, :16] == 1)


def test_inputs_of_another_size_are_centre_cropped_and_resized():
    wide = torch.rand(1, HEIGHT, 2 * WIDTH, 3)
    fields = task_inputs("i2v", WIDTH, HEIGHT, 9, image=wide)
    assert fields["control_video"].shape == (1, HEIGHT, WIDTH, 3)
    assert 0.0 <= float(fields["control_video"].min()) and float(fields["control_video"].max()) <= 1.0


def test_the_docs_tiny_model_commands_run_as_written(tmp_path):
    page = (REPO / "docs" / "offline-command.md").read_text()
    (commands,) = [block.split("```")[0] for block in page.split("```bash\n")[1:] if "load.tiny" in block]
    assert ".venvs/current/bin/python" in commands and "/tmp/" in commands
    # /tmp/ first: a clone under /tmp has it in sys.executable too.
    commands = commands.replace("/tmp/", f"{tmp_path}/").replace(
        ".venvs/current/bin/python", shlex.quote(sys.executable)
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _frames_of(tmp_path / "out.mp4").shape == (9, HEIGHT, WIDTH, 3)
