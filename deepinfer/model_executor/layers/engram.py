"""Engram n-gram memory gate (docs/model.md §3.7): table lookup, projection, per-stream gated add."""
import torch



def engram_embed(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table: [R, head_dim] dequantized; rows: [T, K] (-1 = no lookup -> zeros). -> [T, K * head_dim]."""
    safe = rows.clamp(min=0)
    e = table[safe]
    e = e.masked_fill((rows < 0)[..., None], 0)
    return e.reshape(rows.shape[0], -1)


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """x: [T, n, D] trunk; kv: [T, (n+1) * D] projected memory. Returns the gated trunk.
    dot_i = <x_i*wq_i, k_i*wk_i> * rstd(x_i) * rstd(k_i) / sqrt(D); g = sigmoid(sign*sqrt(max(|dot|,1e-6)))."""
    t, n, dim = x.shape
    kv = kv.float().view(t, n + 1, dim)
    k, v = kv[:, :n], kv[:, n]
    xf = x.float()
    rx = torch.rsqrt(xf.square().mean(-1) + eps)
    rk = torch.rsqrt(k.square().mean(-1) + eps)
    dot = (xf * q_weight.float()[None] * k * k_weight.float()[None]).sum(-1) * rx * rk * dim ** -0.5
    g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    return (xf + g[..., None] * v[:, None, :]).to(x.dtype)
