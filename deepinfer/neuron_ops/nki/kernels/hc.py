"""mHC (manifold-constrained hyper-connections): the mixes, the collapse (pre) and the expand (post).

Tokens are on partitions (<= 128 a tile), so every per-token quantity is a (P, 1) vector and the
n x n Sinkhorn matrices live as n*n columns (row j = columns j*n .. j*n + n - 1).

hc_mixes: m = (flat x @ fn^T) * rsqrt(mean(flat x^2) + eps) in fp32: flat x^T tiles [128, T]
(Tensor Engine transposes) stationary against fn^T [128, 2n + n^2] (laid partition-major on the host,
one load) moving, over all K = n*D in one PSUM bank; the sum of squares from the Scalar Engine's
reduction while loading. Then pre = sigmoid(m_pre * s0 + b_pre) + eps, post = 2 sigmoid(m_post * s1
+ b_post), comb = Sinkhorn(m_comb * s2 + b_comb): per-row softmax + eps, a column normalisation, and
iters - 1 (row, column) rounds, unrolled as Vector Engine ops on 4-column slices.
hc_pre: u = sum_i pre_i X[i]; hc_post: X'[k] = post_k y + sum_j comb[j, k] X[j]; both fp32
multiply-adds (one scalar_tensor_tensor per term) narrowed once to the trunk dtype."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

ROW_TILE = 128     # tokens per tile (partitions)
K_TILE = 128       # contraction rows per projection matmul
X_CHUNK = 2048     # trunk columns loaded per DMA
FREE_CHUNK = 2048  # hidden columns per pre/post tile


def _streams(mix_width: int) -> int:
    """n from the mix width 2n + n^2 = (n + 1)^2 - 1."""
    n = int(round((mix_width + 1) ** 0.5)) - 1
    assert 2 * n + n * n == mix_width, f"mix width {mix_width} is not 2n + n^2"
    return n


def _row_normalise(c, n, eps):
    for j in range(n):
        block = c[:, j * n:(j + 1) * n]
        total = nisa.tensor_reduce(nl.add, block, axis=1, keepdims=True)
        c[:, j * n:(j + 1) * n] = nisa.tensor_scalar(block, nl.divide, nisa.tensor_scalar(total, nl.add, eps))


def _col_normalise(c, n, eps):
    total = c[:, 0:n]
    for j in range(1, n):
        total = nisa.tensor_tensor(total, c[:, j * n:(j + 1) * n], nl.add)
    total = nisa.tensor_scalar(total, nl.add, eps)
    for j in range(n):
        c[:, j * n:(j + 1) * n] = nisa.tensor_tensor(c[:, j * n:(j + 1) * n], total, nl.divide)


@nki.jit
def hc_mixes_kernel(x, fn_p, base, scale, norm_eps, hc_eps, iters):
    """x: [T, K] flat trunk (K = n*D); fn_p: [128, ceil(K/128), M] fp32, fn_p[p, c, :] = fn[:, c*128 + p]
    (zero rows past K); base: [1, M]; scale: [1, 3]. Returns pre [T, n], post [T, n], comb [T, n*n] fp32."""
    t_count, k = x.shape
    mix = fn_p.shape[2]
    n = _streams(mix)
    pre_out = nl.ndarray((t_count, n), dtype=nl.float32, buffer=nl.shared_hbm)
    post_out = nl.ndarray((t_count, n), dtype=nl.float32, buffer=nl.shared_hbm)
    comb_out = nl.ndarray((t_count, n * n), dtype=nl.float32, buffer=nl.shared_hbm)
    fn_all = nl.load(fn_p, dtype=nl.float32)                                             # [128, C, M]
    base_row = nl.load(base, dtype=nl.float32)
    scale_row = nl.load(scale, dtype=nl.float32)
    for r0 in nl.static_range(0, t_count, ROW_TILE):
        rows = min(ROW_TILE, t_count - r0)
        ssq = nisa.memset((rows, 1), 0.0, nl.float32)
        m_ps = nl.zeros((rows, mix), dtype=nl.float32, buffer=nl.psum)
        for x0 in nl.static_range(0, k, X_CHUNK):
            xw = min(X_CHUNK, k - x0)
            xs = nl.load(x[r0:r0 + rows, x0:x0 + xw], dtype=nl.float32)
            part = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(nl.square, xs, reduce_op=nl.add, reduce_res=part)
            ssq = nisa.tensor_tensor(ssq, part, nl.add)
            for k0 in range(x0, x0 + xw, K_TILE):
                kk = min(K_TILE, x0 + xw - k0)
                x_t = nisa.tensor_copy(nisa.nc_transpose(xs[:, k0 - x0:k0 - x0 + kk]))   # [kk, rows]
                m_ps += nisa.nc_matmul(x_t, fn_all[0:kk, k0 // K_TILE, :])
        var = nisa.tensor_scalar(ssq, nl.divide, float(k), op1=nl.add, operand1=norm_eps)
        rstd = nisa.activation(nl.rsqrt, var)
        m = nisa.tensor_scalar(m_ps, nl.multiply, rstd)                                  # [rows, M]
        base_b = nl.broadcast_to(base_row, shape=(rows, mix))
        scale_b = nl.broadcast_to(scale_row, shape=(rows, 3))

        def affine(lo, hi, which):
            return nisa.scalar_tensor_tensor(data=m[:, lo:hi], op0=nl.multiply, operand0=scale_b[:, which:which + 1],
                                             op1=nl.add, data1=base_b[:, lo:hi])

        pre = nisa.tensor_scalar(nisa.activation(nl.sigmoid, affine(0, n, 0)), nl.add, hc_eps)
        post = nisa.tensor_scalar(nisa.activation(nl.sigmoid, affine(n, 2 * n, 1)), nl.multiply, 2.0)
        z = affine(2 * n, mix, 2)
        c = nl.ndarray((rows, n * n), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(n):          # softmax over each row, + eps
            row = z[:, j * n:(j + 1) * n]
            neg_max = nisa.tensor_reduce(nl.max, row, axis=1, keepdims=True, negate=True)
            total = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
            ex = nisa.activation(nl.exp, row, bias=neg_max, reduce_op=nl.add, reduce_res=total)
            c[:, j * n:(j + 1) * n] = nisa.tensor_scalar(ex, nl.divide, total, op1=nl.add, operand1=hc_eps)
        _col_normalise(c, n, hc_eps)
        for _ in range(iters - 1):
            _row_normalise(c, n, hc_eps)
            _col_normalise(c, n, hc_eps)
        nl.store(pre_out[r0:r0 + rows, :], pre)
        nl.store(post_out[r0:r0 + rows, :], post)
        nl.store(comb_out[r0:r0 + rows, :], c)
    return pre_out, post_out, comb_out


@nki.jit
def hc_pre_kernel(x, pre):
    """x: [T, n, D]; pre: [T, n] fp32. Returns u [T, D] = sum_i pre_i X[i] in x's dtype."""
    t_count, n, d = x.shape
    out = nl.ndarray((t_count, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for r0 in nl.static_range(0, t_count, ROW_TILE):
        rows = min(ROW_TILE, t_count - r0)
        w = nl.load(pre[r0:r0 + rows, :], dtype=nl.float32)
        for c0 in nl.static_range(0, d, FREE_CHUNK):
            cw = min(FREE_CHUNK, d - c0)
            acc = nisa.tensor_scalar(nl.load(x[r0:r0 + rows, 0, c0:c0 + cw]), nl.multiply, w[:, 0:1],
                                     dtype=nl.float32)
            for i in range(1, n):
                acc = nisa.scalar_tensor_tensor(data=nl.load(x[r0:r0 + rows, i, c0:c0 + cw]), op0=nl.multiply,
                                                operand0=w[:, i:i + 1], op1=nl.add, data1=acc,
                                                dtype=x.dtype if i == n - 1 else nl.float32)
            if n == 1:
                acc = nisa.tensor_copy(acc, dtype=x.dtype)
            nl.store(out[r0:r0 + rows, c0:c0 + cw], acc)
    return out


@nki.jit
def hc_post_kernel(x, y, post, comb):
    """x: [T, n, D]; y: [T, D]; post: [T, n] fp32; comb: [T, n*n] fp32 (row j = source stream).
    Returns X' [T, n, D] in x's dtype, X'[k] = post_k y + sum_j comb[j, k] X[j]."""
    t_count, n, d = x.shape
    out = nl.ndarray((t_count, n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for r0 in nl.static_range(0, t_count, ROW_TILE):
        rows = min(ROW_TILE, t_count - r0)
        pw = nl.load(post[r0:r0 + rows, :], dtype=nl.float32)
        cm = nl.load(comb[r0:r0 + rows, :], dtype=nl.float32)
        for c0 in nl.static_range(0, d, FREE_CHUNK):
            cw = min(FREE_CHUNK, d - c0)
            xs = [nl.load(x[r0:r0 + rows, j, c0:c0 + cw]) for j in range(n)]
            ys = nl.load(y[r0:r0 + rows, c0:c0 + cw])
            for k in range(n):
                mixed = nisa.tensor_scalar(xs[0], nl.multiply, cm[:, k:k + 1], dtype=nl.float32)
                for j in range(1, n):
                    c_jk = cm[:, j * n + k:j * n + k + 1]
                    mixed = nisa.scalar_tensor_tensor(data=xs[j], op0=nl.multiply, operand0=c_jk, op1=nl.add,
                                                      data1=mixed, dtype=nl.float32)
                res = nisa.scalar_tensor_tensor(data=ys, op0=nl.multiply, operand0=pw[:, k:k + 1], op1=nl.add,
                                                data1=mixed, dtype=x.dtype)
                nl.store(out[r0:r0 + rows, k, c0:c0 + cw], res)
    return out
