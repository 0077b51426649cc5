"""The process groups of one rank, built from its ParallelLayout once torch.distributed is up.

torch.distributed.new_group must be entered by every rank for every group, in the same order, even for
groups the rank is not in; ParallelLayout.all_groups gives that order. A group of one rank is None:
comm.py turns every collective over it into the identity, so a single-rank model runs no collective.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.distributed.parallel_layout import ParallelLayout


@dataclass
class ParallelGroups:
    layout: ParallelLayout
    cp: object = None          # torch.distributed ProcessGroup, or None for a single rank
    lane: object = None
    ep: object = None
    dp_leaders: object = None

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls(ParallelLayout())

    @classmethod
    def create(cls, layout: ParallelLayout, backend: str | None = None) -> "ParallelGroups":
        """Every subgroup of the layout (torch.distributed must already be initialised with
        world_size == layout.world_size)."""
        import torch.distributed as dist
        if layout.world_size == 1:
            return cls(layout)
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.create: torch.distributed is not initialised")
        if dist.get_world_size() != layout.world_size or dist.get_rank() != layout.rank:
            raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"layout says rank {layout.rank} of {layout.world_size}")
        mine = {}
        for kind, groups in layout.all_groups().items():
            for ranks in groups:
                pg = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
                if layout.rank in ranks:
                    mine[kind] = pg
        return cls(layout, **mine)
