"""Softmax-gated pooling of projected token rows into compressed entries (docs/model.md §3.4, §3.5)."""
import torch

from deepinfer.model_executor.layers.concat_rows import concat_rows


def pool_entries(c: torch.Tensor, z: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """c, z: [E, S, width] gathered slots (z includes any APE); valid: [E, S].
    Per channel softmax over the S slots in fp32; the weighted sum is taken in c's dtype."""
    zf = z.float().masked_fill(~valid[..., None], float("-inf"))
    w = torch.softmax(zf, dim=1).to(c.dtype)
    c = c.masked_fill(~valid[..., None], 0)
    return (c * w).sum(dim=1)


def gather_overlap_slots(rows: torch.Tensor, src_idx: torch.Tensor, width: int, overlap: bool,
                         new: torch.Tensor | None = None):
    """rows: [R, 2 * W2] stored as [c | z] with W2 = 2*width (overlap) or width; src_idx indexes rows,
    or cat([rows, new]) when `new` is given (gathered without building it: layers/concat_rows.py).
    Returns c, z of shape [E, S, width]. With overlap, the first m slots take the A-half (channels
    [0, width)) of window w-1 and the last m slots the B-half ([width, 2*width)) of window w."""
    g = rows[src_idx] if new is None else concat_rows(rows, new, src_idx)  # [E, S, 2*W2]
    w2 = g.shape[-1] // 2
    c, z = g[..., :w2], g[..., w2:]
    if not overlap:
        return c, z
    m = src_idx.shape[1] // 2
    c = torch.cat([c[:, :m, :width], c[:, m:, width:]], dim=1)
    z = torch.cat([z[:, :m, :width], z[:, m:, width:]], dim=1)
    return c, z
