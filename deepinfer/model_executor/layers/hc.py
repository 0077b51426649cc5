"""Manifold-constrained hyper-connections (mHC), docs/model.md §3.2."""
import torch


def sinkhorn_out_of_place(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn` as plain out-of-place ops on [..., n, n]: what autograd needs (training) and what a
    compiler fuses best (a compiled prompt step, worker/runners/prompt_kernels.py). Eagerly it is the
    in-place form's bit for bit, only slower."""
    c = torch.softmax(c0, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def sinkhorn(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """c0: [..., n, n] logits (row j = source stream, col k = destination). Softmax over the last axis,
    +eps, then alternate column/row normalisation; the first step is a column normalisation."""
    if c0.requires_grad:  # training (draft distillation): the same ops, out of place for autograd
        return sinkhorn_out_of_place(c0, iters, eps)
    # in place, on an [n, n, T] copy (T = the leading dims): the normalisations then sum and divide
    # contiguous T-long vectors instead of strided runs of n, the same additions in the same order,
    # so the result is the [T, n, n] form's bit for bit (tests/unit/test_layers.py); 2.7x faster at
    # T = 1024 and never slower down to T = 1 (one thread, measured)
    n = c0.shape[-1]
    c = torch.softmax(c0, dim=-1).reshape(-1, n, n).permute(1, 2, 0).contiguous().add_(eps)
    c.div_(c.sum(dim=0, keepdim=True).add_(eps))
    for _ in range(iters - 1):  # ~6 small ops per iteration, per sub-layer
        c.div_(c.sum(dim=1, keepdim=True).add_(eps))
        c.div_(c.sum(dim=0, keepdim=True).add_(eps))
    return c.permute(2, 0, 1).contiguous().view(c0.shape)   # row-major, as custom ops' fakes promise


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float, hc_eps: float, iters: int):
    """x: [T, n, D] trunk. Returns pre [T, n], post [T, n], comb [T, n, n] (all fp32)."""
    pre, post, comb_logits = hc_gates(x, fn, base, scale, norm_eps, hc_eps)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def hc_gates(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float, hc_eps: float):
    """The mixes before Sinkhorn: pre [T, n], post [T, n] and the comb logits [T, n, n] (fp32)."""
    t, n, dim = x.shape
    flat = x.reshape(t, n * dim).float()
    # unweighted RMS over all n*D values applied after the GEMM (equal to fn @ RMS(x))
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = (flat @ fn.float().t()) * rstd
    base = base.float()
    scale = scale.float()
    m_pre, m_post, m_comb = m.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    post = 2.0 * torch.sigmoid(m_post * scale[1] + b_post)
    return pre, post, (m_comb * scale[2] + b_comb).view(t, n, n)


def hc_pre_apply(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = sum_i pre_i * X[i] in fp32, cast to the trunk dtype."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_post_apply(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post_k * y + sum_j comb[j, k] X[j] (comb applied transposed), in fp32."""
    mixed = torch.bmm(comb.transpose(1, 2), x.float())
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def hc_post_broadcast(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`hc_post_apply` with the n x n mix as a broadcast multiply and a sum over the source stream: a
    compiler fuses it into one loop (worker/runners/prompt_kernels.py), where a batch of T n x n GEMMs
    stays a library call (3.4 ms at T = 2048 on this CPU). Eagerly the [T, n, n, D] product makes it
    slower; equal to `hc_post_apply` to rounding (the same n products, summed in another order)."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(2)).sum(dim=1)
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def hc_head_weights(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    norm_eps: float, hc_eps: float) -> torch.Tensor:
    """V4 HC head: w = sigmoid(scale * (fn @ RMS(flat X)) + base) + eps, [T, n]."""
    t, n, dim = x.shape
    flat = x.reshape(t, n * dim).float()
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = (flat @ fn.float().t()) * rstd
    return torch.sigmoid(m * scale.float() + base.float()) + hc_eps
