"""Sink softmax attention over gathered key records (docs/model.md §3.3).

One query attends to its SWA window plus a set of compressed entries; both arrive as gathered
[T, K, d] records with validity masks, which is the shape the sparse-attention kernel consumes."""
import torch

_QUERY_CHUNK = 256  # bounds the [chunk, H, K] score tensor for long prefills


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                   scale: float, rows_fn=None) -> torch.Tensor:
    """q: [T, H, d]; keys: [T, K, d] (K = V); valid: [T, K]; sink: [H] effective logits.
    p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)), all in fp32. rows_fn: what computes one query
    chunk (`sink_attention_rows` or a compiled copy of it, worker/runners/prompt_kernels.py)."""
    t, h, d = q.shape
    rows_fn = rows_fn or sink_attention_rows
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    sink_f = sink.float().view(1, h, 1)
    for s in range(0, t, _QUERY_CHUNK):
        e = min(t, s + _QUERY_CHUNK)
        out[s:e] = rows_fn(q[s:e], keys[s:e], valid[s:e], sink_f, scale)
    return out.to(q.dtype)


def sink_attention_rows(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink_f: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """fp32 [t, H, d]: `sink_attention` of one chunk of query rows; sink_f: [1, H, 1] fp32."""
    t, h = q.shape[0], q.shape[1]
    kf = keys.float()
    scores = torch.einsum("thd,tkd->thk", q.float(), kf) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([scores, sink_f.expand(t, h, 1)], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, kf)
