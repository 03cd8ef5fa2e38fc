"""The versioned channel between the ComfyUI process and rank 0, and between ranks through the store.

Every message is a dict `{"version": PROTOCOL_VERSION, "kind": ..., ...}` of plain values and tensors,
written with `torch.save` and read with `torch.load(weights_only=True)`: nothing on the wire can run code,
and both ends refuse a message of another protocol version (a worker from another checkout of the pack).
"""

from __future__ import annotations

import dataclasses
import io

import torch

from ..errors import WanVACEError

PROTOCOL_VERSION = 3


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


def tensor_fields(value) -> dict:
    """A dataclass's fields, tensors as CPU tensors: a worker on another machine has its own device numbering."""
    return {
        field.name: item.cpu() if isinstance(item, torch.Tensor) else item
        for field in dataclasses.fields(value)
        for item in [getattr(value, field.name)]
    }


def on_device(fields: dict, device: torch.device) -> dict:
    """`tensor_fields`' inverse: the tensors moved onto `device`."""
    return {name: item.to(device) if isinstance(item, torch.Tensor) else item for name, item in fields.items()}
