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

The partials leave the expert kernel in the compute dtype (the kernel contract), then travel in fp32:
in fp32 models they are exact fp32 partials; in bf16 each rank's partial has one bf16 rounding.
"""
from __future__ import annotations

import torch

from deepinfer.distributed import comm

NO_EXPERT = -1   # expert id of a pair that selects nothing (placeholder rows)


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
                      k, static_shapes: bool) -> torch.Tensor:
    """The routed experts' sum for this rank's rows [T, D] in x's dtype, experts split over moe.ep."""
    if token_valid is not None:
        idx = torch.where(token_valid[:, None], idx, torch.full_like(idx, NO_EXPERT))
    if moe.tokens_replicated:
        return comm.all_reduce(local_partials(moe, x, idx, w, k, static_shapes), moe.ep).to(x.dtype)
    gathered = comm.all_gather(pack_rows(x, w, idx), moe.ep)                  # [ep * T, nbytes]
    xs, ws, ids = unpack_rows(gathered, x.shape[1], x.dtype, idx.shape[1])
    partial = local_partials(moe, xs, ids, ws, k, static_shapes)               # [ep * T, D] fp32
    return comm.reduce_scatter(partial, moe.ep).to(x.dtype)
