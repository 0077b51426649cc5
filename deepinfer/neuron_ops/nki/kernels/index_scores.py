"""Indexer scores: score[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[t, e]) * key_scale, -inf where
the entry is invalid (the reference's masking value: stable_topk drops -inf entries).

Per token: q^T [d, nI] (stationary, d in 128-row blocks) against K^T [d, <=512 entries] (moving,
the entries' records transposed 128 at a time on the Tensor Engine) into one fp32 PSUM bank; ReLU
while evacuating it (Scalar Engine); the weighted head sum as a second matmul, the weights column
[nI, 1] (times key_scale, folded in once per token) stationary against ReLU(S) [nI, entries]; the
mask as a Vector Engine select while evacuating that result. Both matmuls run in the wider of q's
and the keys' dtypes (the model decodes keys to fp32)."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

ENTRY_CHUNK = 512   # entries per PSUM bank (fp32)
KEY_ROWS = 128      # entry records transposed per Tensor Engine transpose
D_TILE = 128
HEAD_TILE = 128     # heads per score matmul (stationary free size)


@nki.jit
def index_scores_kernel(q, keys, weights, valid, key_scale):
    """q: [T, nI, d]; keys: [T, E, d]; weights: [T, nI, 1] fp32; valid: [T, E] uint8; key_scale:
    float. Returns [T, E] fp32."""
    t_count, heads, d = q.shape
    e = keys.shape[1]
    out = nl.ndarray((t_count, e), dtype=nl.float32, buffer=nl.shared_hbm)
    mm_dtype = nl.float32 if nl.float32 in (q.dtype, keys.dtype) else q.dtype
    d_blocks = [(d0, min(D_TILE, d - d0)) for d0 in range(0, d, D_TILE)]
    h_blocks = [(h0, min(HEAD_TILE, heads - h0)) for h0 in range(0, heads, HEAD_TILE)]
    for t in nl.static_range(t_count):
        q_t, w_col = [], []
        for h0, hs in h_blocks:
            q_rows = nl.load(q[t, h0:h0 + hs, :])                                       # [heads, d]
            q_t.append([nisa.tensor_copy(nisa.nc_transpose(q_rows[:, d0:d0 + ds]), dtype=mm_dtype)
                        for d0, ds in d_blocks])
            w_col.append(nisa.tensor_scalar(nl.load(weights[t, h0:h0 + hs, :], dtype=nl.float32), nl.multiply,
                                            key_scale))                                  # [heads, 1]
        for c0 in nl.static_range(0, e, ENTRY_CHUNK):
            n = min(ENTRY_CHUNK, e - c0)
            k_t = [nl.ndarray((ds, n), dtype=mm_dtype, buffer=nl.sbuf) for _, ds in d_blocks]
            for r0 in range(0, n, KEY_ROWS):
                nr = min(KEY_ROWS, n - r0)
                rec = nl.load(keys[t, c0 + r0:c0 + r0 + nr, :])                           # [nr, d]
                for (d0, ds), kt in zip(d_blocks, k_t):
                    kt[:, r0:r0 + nr] = nisa.tensor_copy(nisa.nc_transpose(rec[:, d0:d0 + ds]), dtype=mm_dtype)
            total = nl.zeros((1, n), dtype=nl.float32, buffer=nl.psum)
            for (h0, hs), qg, wg in zip(h_blocks, q_t, w_col):
                s = nl.zeros((hs, n), dtype=nl.float32, buffer=nl.psum)
                for qt, kt in zip(qg, k_t):
                    s += nisa.nc_matmul(qt, kt)
                relu_s = nisa.activation(nl.relu, s, dtype=nl.float32)                   # ReLU at evacuation
                total += nisa.nc_matmul(wg, relu_s)                                      # head sum
            ok = nl.load(valid[t:t + 1, c0:c0 + n])
            nl.store(out[t:t + 1, c0:c0 + n], nl.where(ok, total, float("-inf"), dtype=nl.float32))
    return out
