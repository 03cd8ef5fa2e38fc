"""The largest video a model can run, and the refusal of one it cannot.

diffusers' `WanRotaryPosEmbed` holds a table of `rope_max_seq_len` positions per axis and slices it per call: an
axis with more patches than that fails deep inside the first step (`shape '[1, 1, 52, -1]' is invalid` for 832 px
on a model with 32 positions). Each axis counts patches of the latent: width and height in pixels / VAE stride /
patch size, time in latent frames per transformer call (the reference frames in front of the video included, and
with context windows one window). Wan2.2-VACE-Fun-A14B has 1024 positions (16,384 px per side); the tiny test model
32 (512 px, 125 frames).

Every entry checks the same rule from here, before anything slow: the nodes at queue time (from the graph) and when
they run, the offline command before it loads the model, and `prepare_conditioning` / `sample` for whatever comes
in another way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import WanVACEInputError, WanVACEModelFolderError
from ..load.folder_layout import inspect_pipeline_folder
from .windows import VAE_FRAMES_PER_LATENT, ContextWindowOptions, frames_per_call


@dataclass(frozen=True)
class SizeNames:
    """How the caller spells the inputs a refusal names (the nodes' inputs, or the command line's flags)."""

    width: str = "width"
    height: str = "height"
    length: str = "length"
    context_length: str = "context_length"
    # How to add context windows there ("{}" is the largest window that fits).
    add_windows: str = "connect WanVACE Context Windows with context_length {} or less"


@dataclass(frozen=True)
class SizeLimits:
    """What bounds the video size of one model: its RoPE table and how pixels become patches."""

    rope_max_seq_len: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    vae_spatial: int = 8
    vae_temporal: int = VAE_FRAMES_PER_LATENT

    @property
    def max_height(self) -> int:
        return self.rope_max_seq_len * self.patch_size[1] * self.vae_spatial

    @property
    def max_width(self) -> int:
        return self.rope_max_seq_len * self.patch_size[2] * self.vae_spatial

    @property
    def max_latent_frames(self) -> int:
        """Latent frames of one transformer call, reference frames included."""
        return self.rope_max_seq_len * self.patch_size[0]

    def max_frames(self, references: int = 0) -> int:
        """The longest 4n+1 video one call holds beside `references` reference frames (0 if none fits)."""
        latent = self.max_latent_frames - references
        return 0 if latent < 1 else (latent - 1) * self.vae_temporal + 1

    @classmethod
    def from_configs(cls, transformer: dict, vae: dict | None = None) -> SizeLimits:
        """From a transformer config (diffusers' `config.json` keys) and, if known, the VAE's."""
        patch = tuple(int(size) for size in transformer.get("patch_size", (1, 2, 2)))
        downsample = (vae or {}).get("temperal_downsample", [False, True, True])  # diffusers' spelling
        return cls(
            rope_max_seq_len=int(transformer.get("rope_max_seq_len", 1024)),
            patch_size=patch,
            vae_spatial=2 ** len(downsample),
            vae_temporal=2 ** sum(bool(step) for step in downsample),
        )


def size_limits_of(model) -> SizeLimits:
    """The limits of a loaded `WanVACEModel` (its experts share one config)."""
    config = model.reference_expert.config
    return SizeLimits(
        rope_max_seq_len=int(config.rope_max_seq_len),
        patch_size=tuple(int(size) for size in config.patch_size),
        vae_spatial=int(model.helper.vae_scale_factor_spatial),
        vae_temporal=int(model.helper.vae_scale_factor_temporal),
    )


def size_limits_of_folder(path: str | Path) -> SizeLimits:
    """The limits of a diffusers pipeline folder, from its config files only (no weights read)."""
    layout = inspect_pipeline_folder(path, check_weights=False)
    expert = next(layout.components[name] for name in ("transformer", "transformer_2") if name in layout.components)
    configs = {}
    for name, folder in (("transformer", expert.folder), ("vae", layout.components["vae"].folder)):
        config_path = folder / "config.json"
        try:
            configs[name] = json.loads(config_path.read_text())
        except (OSError, ValueError) as error:
            raise WanVACEModelFolderError(f"{config_path} cannot be read ({error}); re-download it.") from error
    return SizeLimits.from_configs(configs["transformer"], configs["vae"])


def size_limits_of_layouts(layouts: dict) -> SizeLimits:
    """The limits of single expert files, from the layouts `inspect_expert_files` read (headers only)."""
    return SizeLimits.from_configs(layouts["transformer"].config, layouts["vae"].config)


def latent_frames(length: int, temporal: int = VAE_FRAMES_PER_LATENT) -> int:
    return (length - 1) // temporal + 1


def check_frame_size(limits: SizeLimits, width: int, height: int, names: SizeNames = SizeNames()) -> None:
    """Refuses a width or height with more patches than the model's RoPE table holds, naming the largest that works."""
    for name, value, largest in ((names.width, width, limits.max_width), (names.height, height, limits.max_height)):
        if value > largest:
            raise WanVACEInputError(
                f"{name}={value} is more than this model can run: its rope_max_seq_len {limits.rope_max_seq_len} "
                f"holds {limits.rope_max_seq_len} patches of {largest // limits.rope_max_seq_len} px per side, so "
                f"{name} can be at most {largest}; use {largest} or less."
            )


def check_frames(
    limits: SizeLimits,
    length: int,
    references: int = 0,
    windows: ContextWindowOptions | None = None,
    names: SizeNames = SizeNames(),
) -> None:
    """Refuses a video whose transformer calls hold more latent frames than the model's RoPE table: the whole video
    and its reference frames, or with `windows` one window and the reference frames."""
    video = latent_frames(length, limits.vae_temporal)
    per_call = frames_per_call(windows, references + video, references)
    if per_call <= limits.max_latent_frames:
        return
    beside = f" beside {references} reference image(s)" if references else ""
    refs = f" plus {references} reference frame(s)" if references else ""
    largest = limits.max_frames(references)
    if largest < 1:
        raise WanVACEInputError(
            f"{references} reference image(s) take {references} of the {limits.max_latent_frames} latent frames this "
            f"model runs per call (rope_max_seq_len {limits.rope_max_seq_len}), leaving none for the video; use at "
            f"most {limits.max_latent_frames - 1} reference images."
        )
    if windows is None:
        raise WanVACEInputError(
            f"{names.length}={length} gives {video} latent frames{refs} per transformer call, more than this model "
            f"runs (its rope_max_seq_len {limits.rope_max_seq_len} holds {limits.max_latent_frames}); use "
            f"{names.length} {largest} or less{beside}, or {names.add_windows.format(largest)}."
        )
    # With windows a call holds one window (or the whole video where it is shorter): a shorter window always fits.
    raise WanVACEInputError(
        f"{names.context_length}={windows.context_length} gives {per_call - references} latent frames{refs} per "
        f"window, more than this model runs per call (its rope_max_seq_len {limits.rope_max_seq_len} holds "
        f"{limits.max_latent_frames}); use {names.context_length} {largest} or less{beside}."
    )


def check_size(
    limits: SizeLimits,
    width: int,
    height: int,
    length: int,
    references: int = 0,
    windows: ContextWindowOptions | None = None,
    names: SizeNames = SizeNames(),
) -> None:
    """`check_frame_size` and `check_frames` together."""
    check_frame_size(limits, width, height, names)
    check_frames(limits, length, references, windows, names)
