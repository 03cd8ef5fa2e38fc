"""ComfyUI's SAMPLER stepping the core's dual-expert denoiser (`wanvace_core.generation.stepping.Stepper`).

A ComfyUI sampler (`KSAMPLER`, from KSamplerSelect or any Sampler* node) is called through its public
`sample(model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)`, with the smallest
stand-in for ComfyUI's guider it reads: a `(x, sigma) -> x0` call, the model's `model_sampling`, and the few
attributes of a model patcher its samplers look up. The model_sampling is ComfyUI's own shifted flow-matching one,
built as its ModelSamplingSD3 node builds it, so noise scaling, sigma bounds and the SNR helpers are ComfyUI's.
"""

from __future__ import annotations

import comfy.model_sampling
import comfy.samplers
import torch

from ..wanvace_core.errors import WanVACEInputError
from ..wanvace_core.generation.stepping import DenoisedParts, Denoiser, StepCallback

# A probe runs the sampler on one latent element with stand-in denoisers.
_PROBE_SHAPE = (1, 1, 1, 1, 1)
_PROBE_SEED = 0


class FlowModelSampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    """ComfyUI's shifted rectified-flow sampling (the class its ModelSamplingSD3 node patches into a model)."""


def flow_model_sampling(shift: float) -> FlowModelSampling:
    """ComfyUI's model_sampling of a flow model at `shift` (ModelSamplingSD3's `set_parameters(shift=...)`)."""
    model_sampling = FlowModelSampling()
    model_sampling.set_parameters(shift=shift, multiplier=1000)
    return model_sampling


class _ModelPatcher:
    """What ComfyUI's samplers ask of the model patcher: its model_sampling (noise scale, SNR bounds)."""

    def __init__(self, model, model_sampling: FlowModelSampling) -> None:
        self.model = model  # ComfyUI 0.33 logs its class name at the first step
        self._model_sampling = model_sampling

    def get_model_object(self, name: str):
        if name != "model_sampling":
            raise WanVACEInputError(
                f"this SAMPLER asks the model for {name!r}, which the WanVACE sampler does not provide; choose "
                "another sampler (KSamplerSelect's euler, dpmpp_2m, uni_pc, ...)."
            )
        return self._model_sampling


class _ModelSamplingHolder:
    def __init__(self, model_sampling: FlowModelSampling) -> None:
        self.model_sampling = model_sampling


class WanVACEDenoiser:
    """The dual-expert denoiser in the place of ComfyUI's guider (`KSAMPLER.sample`'s `model_wrap`)."""

    # The guidance scales live per expert inside the denoiser; ComfyUI 0.33 only logs this.
    cfg = None

    def __init__(self, denoiser: Denoiser, model_sampling: FlowModelSampling, sampler_name: str) -> None:
        self._denoiser = denoiser
        self._sampler_name = sampler_name
        self.inner_model = _ModelSamplingHolder(model_sampling)
        self.model_patcher = _ModelPatcher(self, model_sampling)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, model_options: dict | None = None, seed=None):
        post_cfg = (model_options or {}).get("sampler_post_cfg_function", [])
        if not post_cfg:
            return self._denoiser(x, sigma)
        # CFG++ (cfg_pp) samplers read the negative estimate through a post-CFG function, as ComfyUI's cfg_function
        # hands it to them (the same arguments, in both ComfyUI versions).
        parts = self._denoiser(x, sigma, parts=True)
        if parts.uncond_denoised is None:
            raise cfg_pp_refusal(self._sampler_name)
        denoised = parts.denoised
        for function in post_cfg:
            denoised = function(
                {
                    "denoised": denoised,
                    "cond": None,
                    "uncond": None,
                    "cond_scale": parts.scale,
                    "model": self,
                    "uncond_denoised": parts.uncond_denoised,
                    "cond_denoised": parts.cond_denoised,
                    "sigma": sigma,
                    "model_options": model_options,
                    "input": x,
                }
            )
        return denoised


def cfg_pp_refusal(name: str) -> WanVACEInputError:
    plain = name.replace("_cfg_pp", "")
    other = f"{plain}, its plain variant" if plain != name else "a sampler that is not CFG++ (euler, dpmpp_2m, ...)"
    return WanVACEInputError(
        f"the SAMPLER {name} is a CFG++ (cfg_pp) sampler, which needs each step's negative prediction, but an expert "
        f"of this run has cfg 1 (no negative pass); raise cfg and cfg_low_noise above 1, or choose {other} in "
        "KSamplerSelect."
    )


def sampler_name(sampler) -> str:
    """The name a KSAMPLER's function goes by (`sample_euler` -> `euler`), for messages."""
    name = getattr(sampler.sampler_function, "__name__", type(sampler).__name__)
    return name.removeprefix("sample_")


class ComfySamplerStepper:
    """A ComfyUI `KSAMPLER` as the core's `Stepper`: it walks the sigmas calling the dual-expert denoiser."""

    def __init__(self, sampler: comfy.samplers.KSAMPLER, shift: float) -> None:
        self.sampler = sampler
        self.shift = shift
        self.name = sampler_name(sampler)

    def _sample(self, denoiser: Denoiser, noise, sigmas, seed: int, callback):
        model = WanVACEDenoiser(denoiser, flow_model_sampling(self.shift), self.name)
        sigmas = sigmas.clone()  # ComfyUI's uni_pc writes 0.001 over the final 0 of the sigmas it is given
        extra_args = {"model_options": {"transformer_options": {"sample_sigmas": sigmas}}, "seed": seed}
        latent_image = torch.zeros_like(noise)  # ComfyUI's flow noise scaling needs a latent, and 0 adds nothing
        return self.sampler.sample(model, sigmas, extra_args, callback, noise, latent_image, None, True)

    def run(
        self, denoiser: Denoiser, noise: torch.Tensor, sigmas: torch.Tensor, seed: int, on_step: StepCallback
    ) -> torch.Tensor:
        if not denoiser.negative_pass_everywhere and self._uses_post_cfg(sigmas):
            raise cfg_pp_refusal(self.name)  # before the first step, not at the first step without a negative pass

        def callback(index: int, denoised: torch.Tensor, _x: torch.Tensor, total: int) -> None:
            on_step(index, total, denoised)

        return self._sample(denoiser, noise, sigmas.to(noise.device), seed, callback)

    def _probe(self, sigmas: torch.Tensor, denoised_of) -> tuple[float, ...]:
        called: list[float] = []
        stand_in = _StandIn(lambda x, sigma: called.append(float(sigma.reshape(-1)[0])) or denoised_of(x, sigma))
        self._run_stand_in(stand_in, sigmas)
        return tuple(called)

    def _uses_post_cfg(self, sigmas: torch.Tensor) -> bool:
        """Whether this sampler asks for the negative estimate (CFG++), from a run on one element (its first call)."""
        stand_in = _StandIn(lambda x, _sigma: torch.zeros_like(x))
        self._run_stand_in(stand_in, sigmas[:2])
        return stand_in.asked_for_parts

    def _run_stand_in(self, stand_in, sigmas: torch.Tensor) -> None:

        noise = torch.randn(_PROBE_SHAPE, generator=torch.Generator().manual_seed(_PROBE_SEED))
        self._sample(stand_in, noise, sigmas.to("cpu", torch.float32), _PROBE_SEED, None)

    def call_sigmas(self, sigmas: torch.Tensor) -> tuple[float, ...] | None:
        """The sigma of each denoiser call, from two runs on a one-element latent with stand-in denoisers (a
        clean estimate of 0, and one far from smooth in sigma); None where they differ (an adaptive sampler, whose
        step size follows its error estimate: dpm_adaptive makes 12 calls for the first and 279 for the second over
        ComfyUI's simple schedule of 8 steps)."""
        smooth = self._probe(sigmas, lambda x, _sigma: torch.zeros_like(x))
        rough = self._probe(sigmas, lambda x, sigma: x + 10.0 * torch.sin(1000.0 * sigma).reshape(-1, 1, 1, 1, 1))
        return smooth if smooth == rough else None


class _StandIn:
    """A stand-in denoiser for probing a sampler: `estimate(x, sigma)` as every estimate (a run without guidance)."""

    negative_pass_everywhere = True

    def __init__(self, estimate) -> None:
        self.estimate = estimate
        self.asked_for_parts = False

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, parts: bool = False):
        denoised = self.estimate(x, sigma)
        if not parts:
            return denoised
        self.asked_for_parts = True
        return DenoisedParts(denoised, denoised, denoised, 1.0)


def stepper_for(sampler, shift: float) -> ComfySamplerStepper:
    """The stepper for a SAMPLER input at the run's `shift`; refuses samplers that need ComfyUI's own model."""
    if not isinstance(sampler, comfy.samplers.KSAMPLER):
        kind = type(sampler)
        raise WanVACEInputError(
            f"the SAMPLER input is a {kind.__name__} (from {kind.__module__}), which drives ComfyUI's own model and "
            "cannot step the WanVACE experts; connect KSamplerSelect or a Sampler* node that makes a KSAMPLER "
            "(SamplerEulerAncestral, SamplerDPMPP_2M_SDE, SamplerER_SDE, ...)."
        )
    return ComfySamplerStepper(sampler, shift)
