"""The per-slot state of a cached prefix (docs/prefix_caching.md).

Compressed entries and index keys live in paged blocks, so a block reused by another sequence
already holds them. What a sequence keeps per state slot does not: the SWA ring (the last W
positions' records of every layer, draft layers included) and each compressor's state ring (raw
projected (c, z) rows of the most recent tokens). So every cacheable block also stores a copy of
that state as it is at the block's end, in two block-indexed snapshot stores:

- SWA snapshot: the records of the block's last min(W, block_size) positions, per SWA ring;
- compressor snapshot: for an overlapping compressor of ratio m, its last m positions' state rows.
  block_size is a multiple of every ratio, so a block ends on a window boundary: the next entry
  (w = P / m) pools positions [P, P + m) and, when overlapping, [P - m, P); nothing before P - m
  is ever read again, and a non-overlapping compressor reads nothing from before P at all.

Snapshots are written inside the forward (the rows of a long prompt chunk exist only there) by the
step that completes the block; restored (snapshot -> slot rings) at the start of the first forward
of a sequence whose first `restore_len` positions come from cached blocks. The bytes copied are
exactly the ring rows the slot would hold had it computed the prefix itself, in either record
format, so the rest of the sequence computes bit for bit as without caching.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.model_executor.layers.concat_rows import concat_rows


@dataclass
class StateCopies:
    """Row copies of one ring kind. snap_*: cat([ring, this step's rows])[snap_src] -> store[snap_dst];
    restore_*: store[restore_src] -> ring[restore_dst] (before the forward reads anything)."""
    snap_src: torch.Tensor
    snap_dst: torch.Tensor
    restore_src: torch.Tensor
    restore_dst: torch.Tensor


@dataclass
class PrefixStateIO:
    swa: StateCopies
    comp: dict = field(default_factory=dict)  # (ratio, ring, overlap) of an overlapping compressor -> StateCopies


def swa_snapshot_rows(window: int, block_size: int) -> int:
    return min(window, block_size)


def comp_snapshot_rows(spec: tuple[int, int, bool]) -> int:
    """State rows a block keeps of a compressor (ratio, ring, overlap): only overlap reads back."""
    ratio, _, overlap = spec
    return ratio if overlap else 0


def _lt(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def build_prefix_io(chunks, layout, ctx: torch.Tensor, starts: torch.Tensor) -> PrefixStateIO | None:
    """Copies of a step's chunks (forward_meta.SeqChunk: restore_len, snapshot_upto), None when none.
    starts[b]: flat index of chunk b's first new token (its rows follow the ring's rows)."""
    if not any(c.restore_len or c.snapshot_upto for c in chunks):
        return None
    bs, w = layout.block_size, layout.window
    specs = [(spec, comp_snapshot_rows(spec), layout.state_ring(spec[1]))
             for spec in layout.compressors if comp_snapshot_rows(spec)]
    kinds = [("swa", swa_snapshot_rows(w, bs), layout.swa_ring, w)] + \
            [(spec, rows, ring, rows) for spec, rows, ring in specs]
    lists = {kind: ([], [], [], []) for kind, *_ in kinds}
    for b, c in enumerate(chunks):
        c0, n = int(ctx[b]), c.num_new
        for kind, rows, ring, reach in kinds:
            snap_src, snap_dst, rest_src, rest_dst = lists[kind]
            ring_rows = layout.num_slots * ring
            upto = min(c0 + n, c.snapshot_upto)
            for j in range(c0 // bs, upto // bs):      # blocks that complete in this step
                end = (j + 1) * bs
                for p in range(end - rows, end):
                    snap_src.append(ring_rows + int(starts[b]) + p - c0 if p >= c0
                                    else c.slot * ring + p % ring)
                    snap_dst.append(c.block_table[j] * rows + p - (end - rows))
            p_end = c.restore_len
            for p in range(max(0, p_end - reach), p_end):   # the state the slot holds at restore_len
                j, o = divmod(p, bs)
                rest_src.append(c.block_table[j] * rows + o - (bs - rows))
                rest_dst.append(c.slot * ring + p % ring)
    if not any(any(vals) for vals in lists.values()):
        return None
    copies = {kind: StateCopies(*(_lt(v) for v in vals)) for kind, vals in lists.items()}
    return PrefixStateIO(swa=copies.pop("swa"), comp=copies)


def restore(io: PrefixStateIO, cache) -> None:
    """Copy the restored prefixes' snapshots into their slots' rings (every rank, its own shards)."""
    if io.swa.restore_dst.numel():
        for layer, ring in cache.swa.items():
            ring[io.swa.restore_dst] = cache.swa_snap[layer][io.swa.restore_src]
    for key, spec in cache.state_snap_spec.items():
        copies = io.comp.get(spec)
        if copies is not None and copies.restore_dst.numel():
            cache.comp_state[key][copies.restore_dst] = cache.state_snap[key][copies.restore_src]


def snapshot(store: torch.Tensor | None, copies: StateCopies | None, ring: torch.Tensor,
             new_rows: torch.Tensor) -> None:
    """store[snap_dst] = cat([ring, new_rows])[snap_src], without building the concatenation when the
    snapshot's rows are few (layers/concat_rows.py)."""
    if store is None or copies is None or not copies.snap_dst.numel():
        return
    store[copies.snap_dst] = concat_rows(ring, new_rows, copies.snap_src)
