"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * weight, rows on partitions (128 per tile).

Per row tile: the Scalar Engine squares and sums a row in one activation (its reduction
registers), the Vector Engine forms mean + eps, the Scalar Engine takes the rsqrt, and the Vector
Engine scales by it and by the weight (broadcast to every partition once), all in fp32 before one
narrowing to x's dtype."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl


@nki.jit
def rms_norm_kernel(x, weight, eps):
    """x: [M, D] HBM; weight: [1, D] HBM; eps: float. Returns [M, D] in x's dtype."""
    m, d = x.shape
    out = nl.ndarray((m, d), dtype=x.dtype, buffer=nl.shared_hbm)
    pmax = nl.tile_size.pmax
    w_row = nl.load(weight, dtype=nl.float32)
    w_all = nl.broadcast_to(w_row, shape=(pmax, d))
    for t in nl.static_range((m + pmax - 1) // pmax):
        r0 = t * pmax
        rows = min(pmax, m - r0)
        xt = nl.load(x[r0:r0 + rows, :], dtype=nl.float32)
        ssq = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ssq)
        var = nisa.tensor_scalar(ssq, nl.multiply, 1.0 / d, op1=nl.add, operand1=eps)
        rstd = nisa.activation(op=nl.rsqrt, data=var)
        y = nisa.tensor_scalar(xt, nl.multiply, rstd)
        yw = nisa.tensor_tensor(y, w_all[0:rows, :], nl.multiply, dtype=x.dtype)
        nl.store(out[r0:r0 + rows, :], yw)
    return out
