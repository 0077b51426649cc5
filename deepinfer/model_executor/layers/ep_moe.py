"""Routed experts split over an EP group (docs/neuron.md §5.5): each rank holds a contiguous range of
experts and computes their weighted sum; the ranks' fp32 partials are combined by one collective.

- Tokens replicated in the EP group (the EP group lies inside a CP group): every member already holds
  every token, so each runs its experts on all rows and ONE all-reduce sums the partials.
- EP group spanning CP groups (different tokens per member, the same row count T on each, which the
  process side guarantees by padding with placeholder rows): ONE all-gather of every member's rows
  packed as bytes (x, fp32 router weights, int32 expert ids), each rank runs its experts on the
  gathered rows in (source rank, token) order, and ONE reduce-scatter of the fp32 partials
  [ep * T, D] hands every member the full sum for its own rows. Members of the same CP group send
  identical rows; each block still receives exactly its own expert sum, so nothing is counted twice.
No all_to_all anywhere. Placeholder rows (StepInputs.token_valid False) select no expert.

Fixed-shape steps whose experts each expect many pairs (large prompt chunks, or the gathered rows of
many CP groups) take the capacity-bounded form: each held expert gets `capacity` slots, filled with
its pairs in (row, pair) order, so the expert GEMMs run on n_local * capacity rows instead of every
row. When an expert of any rank overflows its slots, the step takes the dense form instead: the
overflow flag is max-all-reduced over the EP group, so every rank takes the same branch (torch.cond:
a graph op in compiled regions, no host sync; the collectives stay aligned). Decode steps expect a
few pairs per expert, where slots would overflow nearly always, so they keep the dense form and
issue no flag collective. On meta tensors (the full-scale dry run) the slot branch is taken.

The partials leave the expert kernel in the compute dtype (the kernel contract), then travel in fp32:
in fp32 models they are exact fp32 partials; in bf16 each rank's partial has one bf16 rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer.distributed import comm

NO_EXPERT = -1   # expert id of a pair that selects nothing (placeholder rows)
CAPACITY_FACTOR = 2.0   # slots per expert = factor x its mean share of the step's pairs
CAPACITY_MIN_LOAD = 32  # mean pairs per expert below which the dense form is kept (decode steps)


def _local(idx: torch.Tensor, w: torch.Tensor, first: int, n_local: int):
    """Local ids (clamped into range) and weights, zero for pairs routed to another rank's experts."""
    lid = idx - first
    mine = (lid >= 0) & (lid < n_local)
    return torch.where(mine, lid, torch.zeros_like(lid)), torch.where(mine, w, torch.zeros_like(w)), mine


def local_partials(moe, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, k, static_shapes: bool) -> torch.Tensor:
    """fp32 [T, D]: the held experts' weighted outputs for rows x (global ids idx, NO_EXPERT = none).
    Fixed-shape steps run every row (zero weights for other ranks' pairs: no host sync); eager steps
    run only the rows that route at least one pair here."""
    lid, lw, mine = _local(idx, w, moe.expert_start, moe.n_local)
    if static_shapes:
        return moe.run_experts(x, lid, lw, k, True).float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    rows = mine.any(dim=1).nonzero().squeeze(1)
    if rows.numel():
        out[rows] = moe.run_experts(x[rows], lid[rows], lw[rows], k, False).float()
    return out


def capacity(moe, rows: int) -> int | None:
    """Slots per held expert for a fixed-shape step of `rows` rows, or None to keep the dense form
    (a small mean load, or slots that would not save at least half the rows). Python ints only:
    every rank of the EP group decides the same from the same static shape."""
    load = rows * moe.topk / moe.n_experts
    if load < CAPACITY_MIN_LOAD:
        return None
    cap = math.ceil(CAPACITY_FACTOR * load)
    return cap if 2 * moe.n_local * cap <= rows else None


def capacity_slots(lid: torch.Tensor, mine: torch.Tensor, n_local: int, cap: int):
    """(pair index of each slot [n_local * cap], R*k for an empty slot; overflow: 0-dim bool). Slot
    e * cap + j holds expert e's j-th pair in (row, pair) order; pairs past the capacity are dropped
    and raise the overflow flag."""
    flat, keep = lid.reshape(-1), mine.reshape(-1)
    npairs = flat.numel()
    hot = F.one_hot(flat, n_local) * keep[:, None].long()          # [R*k, E]
    rank_in_expert = (hot.cumsum(0) - hot).gather(1, flat[:, None]).squeeze(1)
    fits = keep & (rank_in_expert < cap)
    dump = n_local * cap                                            # one spare slot takes the rest
    slot = torch.where(fits, flat * cap + rank_in_expert, torch.full_like(flat, dump))
    pair_of_slot = torch.full((dump + 1,), npairs, dtype=torch.long, device=lid.device)
    pair_of_slot = pair_of_slot.scatter(0, slot, torch.arange(npairs, device=lid.device))
    return pair_of_slot[:dump], (hot.sum(0) > cap).any()


def capacity_partials(moe, x: torch.Tensor, lw: torch.Tensor, pair_of_slot: torch.Tensor, k,
                      cap: int) -> torch.Tensor:
    """fp32 [R, D]: the held experts on their slots only (fixed shapes: n_local * cap rows)."""
    rows, topk = lw.shape
    pad_row = torch.cat([torch.arange(rows, device=x.device).repeat_interleave(topk),
                         torch.full((1,), rows, device=x.device)])         # pair -> row, empty -> pad
    row = pad_row[pair_of_slot]
    xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[row]
    ws = torch.cat([lw.reshape(-1), lw.new_zeros(1)])[pair_of_slot][:, None]
    ids = torch.arange(moe.n_local, device=x.device).repeat_interleave(cap)[:, None]
    y = moe.run_experts(xs, ids, ws, k, True).float()
    out = torch.zeros(rows + 1, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add(0, row, y)[:rows]


def expert_partials(moe, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, k, static_shapes: bool):
    """local_partials, or for large fixed-shape steps the capacity form with its dense fallback."""
    cap = capacity(moe, x.shape[0]) if static_shapes else None
    if cap is None:
        return local_partials(moe, x, idx, w, k, static_shapes)
    lid, lw, mine = _local(idx, w, moe.expert_start, moe.n_local)
    pair_of_slot, overflow = capacity_slots(lid, mine, moe.n_local, cap)
    flag = comm.all_reduce(overflow.to(torch.int32).reshape(1), moe.ep, "max")

    def dense(x, lid, lw, pair_of_slot):
        return moe.run_experts(x, lid, lw, k, True).float()

    def slots(x, lid, lw, pair_of_slot):
        return capacity_partials(moe, x, lw, pair_of_slot, k, cap)
    if flag.is_meta:   # no values to branch on: shapes and collectives of the slot form
        return slots(x, lid, lw, pair_of_slot)
    return torch.cond(flag[0] > 0, dense, slots, (x, lid, lw, pair_of_slot))


def pack_rows(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """uint8 [T, nbytes]: each row's activations, fp32 router weights and int32 expert ids as bytes."""
    return torch.cat([x.contiguous().view(torch.uint8), w.float().contiguous().view(torch.uint8),
                      idx.to(torch.int32).contiguous().view(torch.uint8)], dim=1)


def unpack_rows(buf: torch.Tensor, dim: int, dtype: torch.dtype, topk: int):
    """Inverse of pack_rows: (x [R, dim] dtype, weights [R, k] fp32, ids [R, k] int64)."""
    nx = dim * torch.empty((), dtype=dtype).element_size()
    x = buf[:, :nx].contiguous().view(dtype)
    w = buf[:, nx:nx + 4 * topk].contiguous().view(torch.float32)
    idx = buf[:, nx + 4 * topk:nx + 8 * topk].contiguous().view(torch.int32).long()
    return x, w, idx


def ep_routed_experts(moe, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, token_valid: torch.Tensor | None,
                      k, static_shapes: bool, shared=None) -> torch.Tensor:
    """The routed experts' sum for this rank's rows [T, D] in x's dtype, experts split over moe.ep.

    shared(rows, k): this rank's fp32 partial of the shared expert (its intermediate units, weighted
    by the runs of ranks the group holds; model_executor/shard_plan.py); added to the routed partials
    before the combine, so the one collective sums both and the result is routed + shared."""
    if token_valid is not None:
        idx = torch.where(token_valid[:, None], idx, torch.full_like(idx, NO_EXPERT))
    if moe.tokens_replicated:
        partial = expert_partials(moe, x, idx, w, k, static_shapes)
        if shared is not None:
            partial = partial + shared(x, k)
        return comm.all_reduce(partial, moe.ep).to(x.dtype)
    gathered = comm.all_gather(pack_rows(x, w, idx), moe.ep)                  # [ep * T, nbytes]
    xs, ws, ids = unpack_rows(gathered, x.shape[1], x.dtype, idx.shape[1])
    partial = expert_partials(moe, xs, ids, ws, k, static_shapes)              # [ep * T, D] fp32
    if shared is not None:   # every gathered row: each member's rows get the group's full shared sum
        partial = partial + shared(xs, k)
    return comm.reduce_scatter(partial, moe.ep).to(x.dtype)
