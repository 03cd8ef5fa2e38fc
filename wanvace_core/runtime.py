"""The one place a loaded model's runtime is put together, in this order:

1. the interleaved VACE forward on each expert (`interleave.apply_interleaved_vace`): it replaces
   `forward`, so it comes first and everything below sees the forward that really runs;
2. the residency for the offload options (`offload.make_residency`): module hooks on the experts
   and, for `layerwise`, on every block of `blocks` and `vace_blocks`; hooks live on the modules, so
   they survive (1) and (3);
3. per sampling run only, cache-dit (`caching.CachedExperts`): it wraps the experts' block lists and
   installs its VACE functor when a run starts and removes both when it ends (also on cancel).

Changing the offload options re-composes (2) over the weights already loaded: nothing is read from
the files again except weights an unload had dropped.
"""

from __future__ import annotations

from .interleave import apply_interleaved_vace
from .offload import OffloadOptions, StreamOps, Transfer, make_residency


def compose(
    model, options: OffloadOptions, transfer: Transfer | None = None, *, stream_ops: StreamOps | None = None
) -> None:
    """Applies (1) and (2) to `model` (a `WanVACEModel`); the previous residency is closed first."""
    for expert in model.experts:
        apply_interleaved_vace(expert)
    model.close_residency()  # the new residency must find the weights unhooked and off the ring
    model.residency = make_residency(
        options, model.components, model.weights, model.device, transfer, stream_ops=stream_ops
    )


def attach_offload(
    model, options: OffloadOptions, transfer: Transfer | None = None, *, stream_ops: StreamOps | None = None
) -> None:
    """Re-attaches `model`'s weights under new offload options (tests pass their own transfer)."""
    compose(model, options, transfer, stream_ops=stream_ops)
