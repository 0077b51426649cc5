"""Sink softmax attention over gathered key records (docs/model.md §3.3).

One query attends to its SWA window plus a set of compressed entries; both arrive as gathered
[T, K, d] records with validity masks, which is the shape the sparse-attention kernel consumes."""
import torch

_QUERY_CHUNK = 256  # bounds the [chunk, H, K] score tensor for long prefills


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q: [T, H, d]; keys: [T, K, d] (K = V); valid: [T, K]; sink: [H] effective logits.
    p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)), all in fp32."""
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    sink_f = sink.float().view(1, h, 1)
    for s in range(0, t, _QUERY_CHUNK):
        e = min(t, s + _QUERY_CHUNK)
        kf = keys[s:e].float()
        scores = torch.einsum("thd,tkd->thk", q[s:e].float(), kf) * scale
        scores = scores.masked_fill(~valid[s:e, None, :], float("-inf"))
        logits = torch.cat([scores, sink_f.expand(e - s, h, 1)], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[s:e] = torch.einsum("thk,tkd->thd", probs, kf)
    return out.to(q.dtype)
