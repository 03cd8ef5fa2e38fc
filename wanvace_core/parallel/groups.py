"""The process groups inside one CFG branch's world, created once per loaded model on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .options import ParallelLayout


@dataclass
class ParallelGroups:
    """This rank's shard mesh and Ulysses group; ranks are those of the branch's default group."""

    layout: ParallelLayout
    rank: int
    device: torch.device
    shard_mesh: DeviceMesh | None
    ulysses_group: dist.ProcessGroup | None

    @classmethod
    def create(cls, layout: ParallelLayout, device: torch.device) -> ParallelGroups:
        if not dist.is_initialized() or dist.get_world_size() != layout.branch_size:
            raise RuntimeError(f"ParallelGroups.create needs a default group of the {layout.branch_size} branch ranks")
        rank = dist.get_rank()
        shape = layout.shard_mesh_shape()
        mesh = None
        if shape:
            names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        ulysses = None
        if layout.ulysses_degree > 1:
            # Every rank creates every group, in the same order, and keeps its own.
            for ranks in layout.ulysses_groups():
                group = dist.new_group(ranks)
                if rank in ranks:
                    ulysses = group
        return cls(layout, rank, device, mesh, ulysses)
