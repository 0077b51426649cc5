"""Top-p, top-k and min-p on fp32 logits [R, V], in place (docs/model.md §6.1 steps 2-3, plus min-p).

Each returns the result of the plain definition, a full stable descending sort (ties: lower
index first), but usually without sorting the vocabulary: torch.topk finds the few entries that
matter, and a stable sort is only used where a run of ties crosses the cut.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
TOP_P_PROBES = (128, 2048, 16384)  # prefix lengths tried before a full sort


def _stable_top(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first m entries (values, indices) of the stable descending sort of each row.

    topk leaves the order of equal values unspecified; sorting its indices ascending and then
    stable-sorting by value restores index order inside each run of ties. A run cut by the m
    boundary may miss lower indices beyond it, so callers only trust runs that end before m.
    """
    top_vals, top_idx = torch.topk(values, m, dim=-1, sorted=True)
    top_idx, by_index = top_idx.sort(dim=-1)
    top_vals, order = top_vals.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
    return top_vals, top_idx.gather(1, order)


def top_p_reference(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """The definition: softmax, full stable sort, drop exclusive cumsum > top_p."""
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p.unsqueeze(1)
    x.masked_fill_(torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted), NEG_INF)


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None = None) -> None:
    """Drop tokens whose exclusive cumulative prob, in stable descending order, exceeds top_p.

    Probes a prefix of the order: once the exclusive cumsum there exceeds top_p, every later token
    is dropped too (the cumsum only grows). A row that will also get top-k (top_k >= 1) is left
    for top-k when its first k tokens all survive top-p, since top-k then decides alone (this
    takes prob order == logit order, which holds unless exp rounds two distinct logits to the
    same prob at the cut).
    """
    vocab = x.shape[-1]
    probs = torch.softmax(x, dim=-1)
    k = top_k if top_k is not None else torch.full_like(top_p, -1, dtype=torch.int64)
    pending = torch.arange(x.shape[0], device=x.device)
    for probe in TOP_P_PROBES:
        if pending.numel() == 0:
            return
        pk = k.index_select(0, pending)
        m = max(probe, int(pk.max()) + 1)
        if m >= vocab:
            break
        vals, idx = _stable_top(probs if pending.numel() == x.shape[0] else probs.index_select(0, pending), m)
        # The cumsum of a prefix is the prefix of the full cumsum (it is sequential).
        drop = (vals.cumsum(dim=-1) - vals) > top_p.index_select(0, pending).unsqueeze(1)
        last_kept = m - 1 - (~drop).flip(-1).int().argmax(dim=-1, keepdim=True)
        tail = vals[:, -1]
        done = drop[:, -1] & (vals.gather(1, last_kept).squeeze(1) > tail)
        kcol = pk.clamp(min=1).unsqueeze(1)
        in_first_k = torch.arange(m, device=x.device).unsqueeze(0) < kcol
        left_to_top_k = ((pk >= 1) & ~(drop & in_first_k).any(dim=-1)
                         & (vals.gather(1, kcol - 1).squeeze(1) > tail))
        if bool(done.any()):
            rows = pending[done]
            src = x[rows.unsqueeze(1), idx[done]].masked_fill(drop[done], NEG_INF)
            kept = torch.full((rows.numel(), vocab), NEG_INF, dtype=x.dtype, device=x.device)
            x.index_copy_(0, rows, kept.scatter_(1, idx[done], src))
        pending = pending[~(done | left_to_top_k)]
    if pending.numel():
        part = x.index_select(0, pending)
        top_p_reference(part, top_p.index_select(0, pending))
        x.index_copy_(0, pending, part)


def top_k_reference(x: torch.Tensor, top_k: torch.Tensor) -> None:
    """Exact stable top-k without a sort: every value above the k-th largest v stays, and of the
    values equal to v the first (k - #above) by index."""
    k = top_k.clamp(min=1, max=x.shape[-1]).unsqueeze(1)
    kth = torch.topk(x, int(k.max()), dim=-1, sorted=True).values.gather(1, k - 1)
    above = x > kth
    equal = x == kth
    room = k - torch.count_nonzero(above, dim=-1).unsqueeze(1)
    equal &= equal.cumsum(dim=-1) <= room
    x.masked_fill_(~(above | equal), NEG_INF)


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep the top_k logits by stable descending rank (ties: lower index first); top_k >= 1.

    topk(k + 1) gives the set directly unless the k-th and (k+1)-th values tie (finite); those
    rows take top_k_reference.
    """
    vocab = x.shape[-1]
    k = top_k.clamp(min=1, max=vocab)
    active = k < vocab
    if not bool(active.any()):
        return
    m = min(int(k[active].max()) + 1, vocab)
    vals, idx = torch.topk(x, m, dim=-1, sorted=True)
    kcol = k.clamp(max=m - 1).unsqueeze(1)
    kth = vals.gather(1, kcol - 1).squeeze(1)
    # A -inf k-th value means fewer than k finite logits: keeping them all is the answer.
    clean = active & ((vals.gather(1, kcol).squeeze(1) < kth) | (kth == NEG_INF))
    result = torch.full_like(x, NEG_INF)
    positions = torch.arange(m, device=x.device).unsqueeze(0)
    result.scatter_(1, idx, vals.masked_fill(positions >= kcol, NEG_INF))
    tied = (active & ~clean).nonzero().squeeze(1)
    if tied.numel():
        part = x.index_select(0, tied)
        top_k_reference(part, k.index_select(0, tied))
        result.index_copy_(0, tied, part)
    inactive = (~active).nonzero().squeeze(1)
    if inactive.numel():
        result.index_copy_(0, inactive, x.index_select(0, inactive))
    x.copy_(result)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob (vLLM's min-p)."""
    probs = torch.softmax(x, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    x.masked_fill_(probs < threshold, NEG_INF)
