"""The loaded pipeline: components plus the facts the sampler needs, and a prompt-embedding cache."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .interleave import apply_interleaved_vace
from .offload import NoOffload

logger = logging.getLogger(__name__)

_PROMPT_CACHE_SIZE = 16


def _log_release(source: str) -> None:
    logger.info("Released WanVACE pipeline %s", source)


@dataclass(eq=False)
class WanVACEModel:
    """A WanVACE pipeline loaded into memory.

    `transformer` is the high-noise expert and `transformer_2` the low-noise one (diffusers naming);
    a Wan2.1-VACE folder has only `transformer`.
    """

    source: Path
    dtype: torch.dtype
    device: torch.device
    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    transformer: torch.nn.Module | None
    transformer_2: torch.nn.Module | None
    scheduler_config: dict
    boundary_ratio: float | None
    max_sequence_length: int = 512
    _prompt_cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    # Re-entrant: ComfyUI may call back into release_device_memory while ensure_loaded asks it for room.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _helper: object = field(default=None, repr=False)
    offload: object = field(default_factory=lambda: NoOffload(), repr=False)
    # Called as on_reload(bytes) before dropped weights are read back, so a host application (ComfyUI)
    # can make room on the device first.
    on_reload: Callable[[int], None] | None = field(default=None, repr=False)
    dropped: set[str] = field(default_factory=set, repr=False)  # components whose weights were dropped
    # (size, mtime) of each weight file at load: a reload must read the same weights back.
    file_stamps: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for expert in self.experts:
            apply_interleaved_vace(expert)
        weakref.finalize(self, _log_release, str(self.source))

    @property
    def components(self) -> dict[str, torch.nn.Module]:
        modules = {"text_encoder": self.text_encoder, "vae": self.vae}
        modules.update({name: getattr(self, name) for name in ("transformer", "transformer_2")})
        return {name: module for name, module in modules.items() if module is not None}

    def _unique_tensors(self, names: Iterable[str] | None, buffers: bool) -> list[torch.Tensor]:
        components = self.components
        unique: dict[int, torch.Tensor] = {}
        for name in components if names is None else names:
            module = components[name]
            for tensor in [*module.parameters(), *(module.buffers() if buffers else ())]:
                unique.setdefault(id(tensor), tensor)
        return list(unique.values())

    def weight_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes of the parameters and buffers (each once) of components `names` (default all) held now."""
        tensors = self._unique_tensors(names, buffers=True)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if not tensor.is_meta)

    def device_bytes(self) -> int:
        """Bytes of weights this model holds on its device now."""
        if isinstance(self.offload, NoOffload):
            return self.weight_bytes()
        return self.offload.device_bytes()

    def release_device_memory(self) -> int:
        """Frees the device memory the weights take (ComfyUI asked for it); returns the bytes released.

        With offload, weights go back to host memory. Without (mode `none`) there is no host copy: the
        parameters are dropped and `ensure_loaded` reads them back from the folder when next needed.
        """
        with self._lock:
            held = self.device_bytes()
            if not isinstance(self.offload, NoOffload):
                self.offload.release_all()
            else:
                self._drop(self.components)
            return held - self.device_bytes()

    def _drop(self, names: Iterable[str]) -> None:
        from .loading import drop_weights

        for name in names:
            drop_weights(self.components[name])
            self.dropped.add(name)

    def ensure_loaded(self, *names: str) -> None:
        """Reads back the dropped weights of components `names` (default all); a no-op for the others."""
        with self._lock:
            wanted = [name for name in (names or self.components) if name in self.dropped]
            if not wanted:
                return
            from .loading import refill_weights

            if self.on_reload is not None:
                self.on_reload(self._parameter_bytes(wanted))
            try:
                refill_weights(self, wanted)
            except BaseException:
                # Half-read components must not hold device memory that no release would find.
                self._drop(wanted)
                raise
            self.dropped.difference_update(wanted)

    def _parameter_bytes(self, names: Iterable[str]) -> int:
        """Bytes the parameters of `names` take when loaded (dropped ones included)."""
        return sum(param.numel() * param.element_size() for param in self._unique_tensors(names, buffers=False))

    @property
    def experts(self) -> list[torch.nn.Module]:
        return [expert for expert in (self.transformer, self.transformer_2) if expert is not None]

    @property
    def reference_expert(self) -> torch.nn.Module:
        """The expert whose config describes both (they share one architecture)."""
        return self.experts[0]

    @property
    def transformer_dtype(self) -> torch.dtype:
        return self.reference_expert.dtype

    @property
    def vace_layers(self) -> list[int]:
        return list(self.reference_expert.config.vace_layers)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler_config.get("num_train_timesteps", 1000))

    @property
    def default_shift(self) -> float:
        for key in ("flow_shift", "shift"):
            if self.scheduler_config.get(key) is not None:
                return float(self.scheduler_config[key])
        return 1.0

    @property
    def spatial_multiple(self) -> int:
        """Width and height must be multiples of this (VAE stride x patch size)."""
        return self.helper.vae_scale_factor_spatial * self.reference_expert.config.patch_size[1]

    @property
    def temporal_stride(self) -> int:
        return self.helper.vae_scale_factor_temporal

    @property
    def helper(self):
        """A diffusers `WanVACEPipeline` over the same modules, for its preparation methods.

        Using the pipeline's own preprocessing keeps our conditioning bitwise equal to diffusers.
        """
        if self._helper is None:
            from diffusers import UniPCMultistepScheduler, WanVACEPipeline

            self._helper = WanVACEPipeline(
                tokenizer=self.tokenizer,
                text_encoder=self.text_encoder,
                vae=self.vae,
                scheduler=UniPCMultistepScheduler.from_config(self.scheduler_config),
                transformer=self.transformer,
                transformer_2=self.transformer_2,
                boundary_ratio=self.boundary_ratio,
            )
        return self._helper

    @torch.no_grad()
    def encode_prompt(self, text: str) -> torch.Tensor:
        """Text embeddings in the transformer dtype; each distinct text is encoded once."""
        with self._lock:
            cached = self._prompt_cache.get(text)
            if cached is not None:
                self._prompt_cache.move_to_end(text)
                return cached
        self.ensure_loaded("text_encoder")
        self.offload.activate("text_encoder")
        embeds = self.helper._get_t5_prompt_embeds(
            prompt=text, max_sequence_length=self.max_sequence_length, device=self.device
        ).to(self.transformer_dtype)
        with self._lock:
            self._prompt_cache[text] = embeds
            while len(self._prompt_cache) > _PROMPT_CACHE_SIZE:
                self._prompt_cache.popitem(last=False)
        return embeds
