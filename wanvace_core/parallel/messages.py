"""The versioned channel between the ComfyUI process and rank 0, and between ranks through the store.

Every message is a dict `{"version": PROTOCOL_VERSION, "kind": ..., ...}` of plain values and tensors,
written with `torch.save` and read with `torch.load(weights_only=True)`: nothing on the wire can run code,
and both ends refuse a message of another protocol version (a worker from another checkout of the pack).
"""

from __future__ import annotations

import dataclasses
import io

import torch

from ..caching import CacheOptions, CacheReport, ExpertCacheLimits, ExpertCacheReport
from ..conditioning import VACEConditioning
from ..errors import WanVACEError
from ..offload import OffloadOptions
from ..sampling import SamplerSettings
from .options import ParallelOptions

PROTOCOL_VERSION = 1


class WanVACEWorkerError(WanVACEError, RuntimeError):
    """A parallel worker failed, hung or spoke another protocol; the message says which and what to do."""


def encode(kind: str, **fields) -> bytes:
    buffer = io.BytesIO()
    torch.save({"version": PROTOCOL_VERSION, "kind": kind, **fields}, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> dict:
    message = torch.load(io.BytesIO(data), weights_only=True)
    version = message.get("version") if isinstance(message, dict) else None
    if version != PROTOCOL_VERSION:
        raise WanVACEWorkerError(
            f"a WanVACE worker message has protocol version {version!r}, this process speaks {PROTOCOL_VERSION}; "
            "start the workers from the same ComfyUI-WanVACE checkout as ComfyUI."
        )
    return message


def plain(value) -> dict:
    """A frozen options dataclass as a dict of plain values (nested dataclasses included)."""
    return dataclasses.asdict(value)


def settings_from(fields: dict) -> SamplerSettings:
    return SamplerSettings(**fields)


def cache_from(fields: dict | None) -> CacheOptions | None:
    if fields is None:
        return None
    fields = dict(fields)
    for name in ("high_noise", "low_noise"):
        fields[name] = ExpertCacheLimits(**fields[name])
    return CacheOptions(**fields)


def offload_from(fields: dict) -> OffloadOptions:
    return OffloadOptions(**fields)


def parallel_from(fields: dict) -> ParallelOptions:
    fields = dict(fields)
    fields["devices"] = tuple(fields["devices"])
    return ParallelOptions(**fields)


def conditioning_fields(cond: VACEConditioning) -> dict:
    """On the wire as CPU tensors: a worker on another machine has its own device numbering."""
    return {
        field.name: value.cpu() if isinstance(value, torch.Tensor) else value
        for field in dataclasses.fields(cond)
        for value in [getattr(cond, field.name)]
    }


def conditioning_from(fields: dict, device: torch.device) -> VACEConditioning:
    return VACEConditioning(
        **{name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in fields.items()}
    )


def report_from(fields: dict | None) -> CacheReport | None:
    if fields is None:
        return None
    experts = tuple(
        ExpertCacheReport(
            **{
                **expert,
                "cached_steps": tuple(expert["cached_steps"]),
                "cfg_cached_steps": tuple(expert["cfg_cached_steps"]),
            }
        )
        for expert in fields["experts"]
    )
    return CacheReport(mode=fields["mode"], experts=experts)
