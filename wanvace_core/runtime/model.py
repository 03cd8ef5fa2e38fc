"""A loaded pipeline made runnable: its residency, parallel workers, per-run LoRAs and a prompt-embedding cache."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..load.loaded import LoadedPipeline, tensor_bytes
from .offload import Residency

logger = logging.getLogger(__name__)

_PROMPT_CACHE_SIZE = 16


def default_shift(scheduler_config: dict) -> float:
    """The flow shift a pipeline's scheduler config sets (1.0 where it sets none)."""
    for key in ("flow_shift", "shift"):
        if scheduler_config.get(key) is not None:
            return float(scheduler_config[key])
    return 1.0


def _log_release(source: str) -> None:
    logger.info("Released WanVACE pipeline %s", source)


@dataclass(eq=False)
class WanVACEModel(LoadedPipeline):
    """A WanVACE pipeline ready to run (`runtime.plan.build_model` makes one from a `LoadedPipeline`).

    `residency` decides where the weights live and `weights` reads dropped ones back (the plan sets up both,
    in one place). `loras` are the LoRA patches (`runtime.lora.LoraPatch`) a sampling run applies to the
    experts, and only for that run; `with_loras` makes a view that shares everything with its base, which
    keeps none.
    """

    # Set when the experts run in parallel workers (`parallel.launcher.RemoteExperts`): `transformer` and
    # `transformer_2` are then meta-device stand-ins that only carry the config, and `sample` goes there.
    remote: object = None
    # The `runtime.plan.RuntimePlan` last applied (None until the plan runs).
    plan: object = None
    loras: tuple = ()
    _base: WanVACEModel | None = field(default=None, repr=False)
    _prompt_cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _helper: object = field(default=None, repr=False)
    _residency: Residency | None = field(default=None, repr=False)
    _close_residency: weakref.finalize | None = field(default=None, repr=False)

    @classmethod
    def from_loaded(cls, loaded: LoadedPipeline) -> WanVACEModel:
        """A model over `loaded`'s components (shared, not copied); no residency yet."""
        return cls(**{item.name: getattr(loaded, item.name) for item in dataclasses.fields(LoadedPipeline)})

    def __post_init__(self) -> None:
        if self._base is None:
            weakref.finalize(self, _log_release, str(self.source))

    @property
    def base(self) -> WanVACEModel:
        """The loaded pipeline itself (a LoRA view's base; a plain model is its own base)."""
        return self if self._base is None else self._base

    def with_loras(self, *patches) -> WanVACEModel:
        """A view that samples with `patches` after this model's own; the weights and this model are unchanged.

        The view shares the components, residency, prompt cache and lock (and keeps the base alive), so
        another branch of a graph that uses this model directly still samples without the patches.
        """
        return dataclasses.replace(self, loras=self.loras + tuple(patches), _base=self.base, _helper=None)

    @property
    def components(self) -> dict[str, torch.nn.Module]:
        modules = {"text_encoder": self.text_encoder, "vae": self.vae}
        if self.remote is None:  # remote experts' weights live in the workers, not here
            modules.update({name: getattr(self, name) for name in ("transformer", "transformer_2")})
        return {name: module for name, module in modules.items() if module is not None}

    @property
    def residency(self) -> Residency:
        return self.base._residency

    def close_residency(self) -> None:
        """Closes the current residency (at most once): hooks removed, device and pinned buffers given back."""
        base = self.base
        if base._close_residency is not None:
            base._close_residency()

    @residency.setter
    def residency(self, residency: Residency) -> None:
        """Replaces the (base's) residency; the old one is closed. The new one closes when the base is dropped."""
        base = self.base
        base.close_residency()
        broker = None if base._residency is None else base._residency.broker
        base._residency = residency
        residency.broker = broker
        # Pinned buffers and hooks must not outlive the model; the finalizer holds no reference to it.
        base._close_residency = weakref.finalize(base, residency.close)

    def weight_bytes(self, names=None) -> int:
        """Bytes of the parameters and buffers (each once) of components `names` (default all) held now."""
        components = self.components
        return tensor_bytes(components[name] for name in (components if names is None else names))

    def activate(self, name: str) -> None:
        """Makes component `name` runnable on the device (reads it back or moves it there as needed)."""
        self.residency.activate(name)

    def device_bytes(self) -> int:
        """Bytes of weights this model holds on its device now."""
        return self.residency.device_bytes()

    def release_device_memory(self) -> int:
        """Frees the device memory the weights take (ComfyUI asked for it); returns the bytes released."""
        with self._lock:
            if self.remote is not None:
                self.remote.close()  # the workers' devices are freed too; the next prompt starts them again
            return self.residency.release_all()

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
        return default_shift(self.scheduler_config)

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
        self.activate("text_encoder")
        embeds, _ = self.helper.encode_prompt(
            prompt=text,
            negative_prompt=None,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        embeds = embeds.to(self.transformer_dtype)
        with self._lock:
            self._prompt_cache[text] = embeds
            while len(self._prompt_cache) > _PROMPT_CACHE_SIZE:
                self._prompt_cache.popitem(last=False)
        return embeds
