"""Sparse selection: indexer scores, stable top-k, and V4.1's candidate-block prefilter
(docs/model.md §3.4, §3.5, §4.3)."""
import torch

_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                 key_scale: float = 1.0) -> torch.Tensor:
    """q: [T, nI, dI]; keys: [T, E, dI] (each row its own) or [E, dI] (a shared scope, every row
    scored against all of it); weights: [T, nI] (fp32).
    score(t, w) = sum_h weights[t, h] * ReLU(<q_h, k_w>) * key_scale; invalid entries -> -inf."""
    eq = "thd,ed->the" if keys.dim() == 2 else "thd,ted->the"
    s = torch.relu(torch.einsum(eq, q.float(), keys.float())) * key_scale
    s = (s * weights.float()[..., None]).sum(dim=1)
    return s.masked_fill(~valid, float("-inf"))


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lower index; -1 where the score is -inf."""
    k = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = scores.gather(1, order)
    return torch.where(picked > float("-inf"), order, torch.full_like(order, -1))


def candidate_blocks(scores: torch.Tensor, n_vis: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """Block selection at the candidate source layer. Returns [T, topk_blocks] block ids sorted ascending,
    -1 padded at the end. Block score = max over the block (bf16-clamped), last valid block forced +inf."""
    t, e = scores.shape
    nblk = max(1, -(-e // block))
    pad = torch.full((t, nblk * block), float("-inf"), dtype=torch.float32, device=scores.device)
    pad[:, :e] = scores.float()
    bmax = pad.view(t, nblk, block).amax(dim=-1).clamp(-_BF16_MAX, _BF16_MAX)
    n_valid_blk = (n_vis + block - 1) // block
    col = torch.arange(nblk, device=scores.device)[None, :]
    bmax = torch.where(col < n_valid_blk[:, None], bmax, torch.full_like(bmax, float("-inf")))
    last = (col == (n_valid_blk[:, None] - 1)) & (n_valid_blk[:, None] > 0)
    bmax = torch.where(last, torch.full_like(bmax, float("inf")), bmax)
    sel = stable_topk(bmax, topk_blocks)  # [T, min(nblk, topk_blocks)]
    # nblk as the "unused" sort key keeps the graph free of int64-max constants (docs/neuron.md §4 A4)
    sel = torch.sort(torch.where(sel >= 0, sel, torch.full_like(sel, nblk)), dim=1).values
    sel = torch.where(sel == nblk, torch.full_like(sel, -1), sel)
    if sel.shape[1] < topk_blocks:
        sel = torch.cat([sel, sel.new_full((t, topk_blocks - sel.shape[1]), -1)], dim=1)
    return sel


def candidate_entry_mask(cand: torch.Tensor, num_entries: int, block: int) -> torch.Tensor:
    """[T, num_entries] True for entries inside a selected candidate block. Built as a [T, blocks]
    hit table and read per entry: [T, num_entries, k] comparisons would be 2 GiB at V4.1-Flash shapes."""
    t = cand.shape[0]
    nblk = -(-num_entries // block)
    # one column past the blocks takes the unused (-1) slots
    ids = torch.where((cand >= 0) & (cand < nblk), cand, torch.full_like(cand, nblk))
    hit = torch.zeros(t, nblk + 1, dtype=torch.bool, device=cand.device).scatter(1, ids, torch.ones_like(ids, dtype=torch.bool))
    return hit[:, torch.arange(num_entries, device=cand.device) // block]
