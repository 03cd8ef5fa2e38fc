"""A WanVACE transformer forward that computes each VACE hint right before the block that consumes it.

diffusers' `WanVACETransformer3DModel.forward` runs all VACE blocks first and keeps every hint alive
through the main blocks (eight hints of ~0.6 GB each at 720p in bf16). The VACE chain depends only
on the patch-embedded input, the control latents and the conditioning, not on the main blocks'
output, so running VACE block k just before main block `vace_layers[k]` gives the same numbers
while holding one hint at a time. It also makes the block execution order the one layerwise
offload streams in: `vace_blocks.k` interleaved before `blocks.vace_layers[k]`.

Sections other than the block loop mirror diffusers' forward line for line so the result is bitwise
equal to the installed stock forward (tested against it in every dependency set). diffusers 0.36 and
0.42 compute the same thing: 0.42 only adds `.to(hidden_states.device)` on each hint (kept here; a no-op
on one device) and moves the LoRA `attention_kwargs["scale"]` handling into a decorator. A call with
`attention_kwargs` (which this pack never passes) therefore runs the installed stock forward, as does
gradient checkpointing.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ..hooks import install_forward, runs_forward

_STOCK_FORWARD = "_wanvace_stock_forward"


def stock_execution_order(transformer: torch.nn.Module) -> list[str]:
    """Block names in the order diffusers' (and cache-dit's VACE functor's) forward runs them: hints first."""
    return [f"vace_blocks.{index}" for index in range(len(transformer.vace_blocks))] + [
        f"blocks.{index}" for index in range(len(transformer.blocks))
    ]


def current_execution_order(transformer: torch.nn.Module) -> list[str]:
    """The block order of whichever forward the transformer has right now."""
    return execution_order(transformer) if uses_interleaved_vace(transformer) else stock_execution_order(transformer)


def _vace_positions(config) -> dict[int, int]:
    """Main-block index -> index of the VACE block whose hint it consumes."""
    return {layer: index for index, layer in enumerate(config.vace_layers)}


def execution_order(transformer: torch.nn.Module) -> list[str]:
    """Block names in the order the interleaved forward runs them."""
    vace_position = _vace_positions(transformer.config)
    order = []
    for index in range(len(transformer.blocks)):
        if index in vace_position:
            order.append(f"vace_blocks.{vace_position[index]}")
        order.append(f"blocks.{index}")
    return order


def _interleaved_forward(
    self,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    control_hidden_states: torch.Tensor = None,
    control_hidden_states_scale: torch.Tensor = None,
    return_dict: bool = True,
    attention_kwargs: dict | None = None,
):
    if attention_kwargs is not None or (torch.is_grad_enabled() and self.gradient_checkpointing):
        return getattr(self, _STOCK_FORWARD)(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image,
            control_hidden_states,
            control_hidden_states_scale,
            return_dict,
            attention_kwargs,
        )
    batch_size, _num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    # No control input (a step outside the conditioning's VACE window): the VACE blocks do not run at all.
    with_hints = control_hidden_states is not None
    if control_hidden_states_scale is None:
        control_hidden_states_scale = hidden_states.new_ones(len(self.config.vace_layers))
    control_hidden_states_scale = torch.unbind(control_hidden_states_scale)
    if len(control_hidden_states_scale) != len(self.config.vace_layers):
        raise ValueError(
            f"Length of `control_hidden_states_scale` {len(control_hidden_states_scale)} should be "
            f"equal to {len(self.config.vace_layers)}."
        )

    rotary_emb = self.rope(hidden_states)

    hidden_states = self.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2)

    if with_hints:
        control_hidden_states = self.vace_patch_embedding(control_hidden_states)
        control_hidden_states = control_hidden_states.flatten(2).transpose(1, 2)
        control_hidden_states_padding = control_hidden_states.new_zeros(
            batch_size, hidden_states.size(1) - control_hidden_states.size(1), control_hidden_states.size(2)
        )
        control_hidden_states = torch.cat([control_hidden_states, control_hidden_states_padding], dim=1)

    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = self.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image
    )
    timestep_proj = timestep_proj.unflatten(1, (6, -1))

    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    # Every VACE block reads the patch-embedded input, not the running main-branch state.
    vace_input = hidden_states
    vace_position = _vace_positions(self.config) if with_hints else {}
    for index, block in enumerate(self.blocks):
        hint = None
        if index in vace_position:
            vace_index = vace_position[index]
            hint, control_hidden_states = self.vace_blocks[vace_index](
                vace_input, encoder_hidden_states, control_hidden_states, timestep_proj, rotary_emb
            )
        hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
        if hint is not None:
            hidden_states = hidden_states + hint.to(hidden_states.device) * control_hidden_states_scale[vace_index]
            del hint
    del vace_input, control_hidden_states

    shift, scale = (self.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift = shift.to(hidden_states.device)
    scale = scale.to(hidden_states.device)

    hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = self.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, p_t, p_h, p_w, -1
    )
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def apply_interleaved_vace(transformer: torch.nn.Module) -> torch.nn.Module:
    """Installs the interleaved forward on one WanVACE transformer instance (idempotent)."""
    if not hasattr(transformer, _STOCK_FORWARD):
        setattr(transformer, _STOCK_FORWARD, transformer.forward)
    install_forward(transformer, _interleaved_forward)
    return transformer


def uses_interleaved_vace(transformer: torch.nn.Module) -> bool:
    return runs_forward(transformer, _interleaved_forward)
