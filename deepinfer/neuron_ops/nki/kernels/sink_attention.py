"""Sink attention over gathered key records (MQA, K = V = the record), one token at a time.

For token t and a group of <= 128 heads (heads on partitions):
  scores  S = q_t . K^T over D in 128-row blocks (q^T stationary [d, H], K^T moving [d, <=512 keys]),
          plus a rank-1 matmul ones[1, H]^T x bias[1, keys] that puts the validity mask on every head
          (bias 0 for a valid key, MASK_NEG for an invalid one) in the same fp32 PSUM bank;
  softmax online over KEY_CHUNK-key chunks in fp32: m starts at the sink logit and l at 1 (the sink's
          exp(sink - m)), so the sink joins the denominator and never the output; per chunk
          m' = max(m, scale * max S), alpha = exp(m - m'), P = exp(scale * S - m') with its row sum
          from the same Scalar Engine instruction, l = alpha * l + sum P;
  P.V     in PV_KEYS-key blocks: P is written in p_dtype (bf16 for bf16 models: the rounding the
          issue prescribes; fp32 for fp32 models, the exact mode), transposed to [keys, H] on the
          Tensor Engine and multiplied with the block's records [keys, D] (moving, <= 512 columns
          per PSUM bank); acc = alpha * acc + P.V on the Vector Engine; out = acc / l.
A token whose keys are all invalid gets P = 0 everywhere, hence out = 0, as the reference.
Records arrive already gathered ([T, E, D], the reference's argument); key tiles are loaded
PV_KEYS rows at a time so each V operand starts at partition 0."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

KEY_CHUNK = 512    # keys scored per PSUM bank (fp32 [H, 512] = 2 KiB a partition)
PV_KEYS = 64       # keys per P.V matmul: P is rounded per block of 64 keys
D_TILE = 128       # contraction rows per score matmul
OUT_TILE = 512     # output columns per P.V PSUM bank
HEAD_TILE = 128    # heads per group (partitions)
MASK_NEG = -1.0e30  # additive score of an invalid key: exp(scale * MASK_NEG - m) == 0 for any finite m


@nki.jit
def sink_attention_kernel(q, keys, valid, sink, scale, p_bf16):
    """q: [T, H, D]; keys: [T, E, D]; valid: [T, E] uint8 (0/1); sink: [H, 1] fp32; scale: float;
    p_bf16: round P to bf16 before P.V (else keep it fp32). Returns [T, H, D] in q's dtype."""
    t_count, heads, d = q.shape
    e = keys.shape[1]
    out = nl.ndarray((t_count, heads, d), dtype=q.dtype, buffer=nl.shared_hbm)
    p_dtype = nl.bfloat16 if p_bf16 else nl.float32
    d_blocks = [(d0, min(D_TILE, d - d0)) for d0 in range(0, d, D_TILE)]
    o_blocks = [(o0, min(OUT_TILE, d - o0)) for o0 in range(0, d, OUT_TILE)]
    for h0 in nl.static_range(0, heads, HEAD_TILE):
        hg = min(HEAD_TILE, heads - h0)
        ones = nisa.memset((1, hg), 1.0, nl.float32)
        for t in nl.static_range(t_count):
            q_rows = nl.load(q[t, h0:h0 + hg, :])                                   # [hg, D]
            q_t = [nisa.tensor_copy(nisa.nc_transpose(q_rows[:, d0:d0 + ds])) for d0, ds in d_blocks]
            m = nl.load(sink[h0:h0 + hg, :], dtype=nl.float32)                        # running max
            l_sum = nisa.memset((hg, 1), 1.0, nl.float32)                              # exp(sink - m)
            acc = nisa.memset((hg, d), 0.0, nl.float32)
            for c0 in nl.static_range(0, e, KEY_CHUNK):
                n = min(KEY_CHUNK, e - c0)
                blocks = [(b0, min(PV_KEYS, n - b0)) for b0 in range(0, n, PV_KEYS)]
                recs = []
                k_t = [nl.ndarray((ds, n), dtype=keys.dtype, buffer=nl.sbuf) for _, ds in d_blocks]
                for b0, nb in blocks:
                    rec = nl.load(keys[t, c0 + b0:c0 + b0 + nb, :])                    # [nb, D]
                    recs.append(rec)
                    for (d0, ds), kt in zip(d_blocks, k_t):
                        kt[:, b0:b0 + nb] = nisa.tensor_copy(nisa.nc_transpose(rec[:, d0:d0 + ds]))
                ok = nl.load(valid[t:t + 1, c0:c0 + n])
                bias = nisa.tensor_scalar(ok, nl.subtract, 1.0, op1=nl.multiply, operand1=-MASK_NEG,
                                          dtype=nl.float32)                            # 0 or MASK_NEG
                s = nl.zeros((hg, n), dtype=nl.float32, buffer=nl.psum)
                for qt, kt in zip(q_t, k_t):
                    s += nisa.nc_matmul(qt, kt)
                s += nisa.nc_matmul(ones, bias)

                s_max = nisa.tensor_reduce(nl.max, s, axis=1, keepdims=True)
                m_new = nisa.tensor_scalar(s_max, nl.multiply, scale, op1=nl.maximum, operand1=m)
                neg_m = nisa.tensor_scalar(m_new, nl.multiply, -1.0)
                alpha = nisa.activation(nl.exp, m, bias=neg_m)
                p_sum = nl.ndarray((hg, 1), dtype=nl.float32, buffer=nl.sbuf)
                p = nisa.activation(nl.exp, s, bias=neg_m, scale=scale, reduce_op=nl.add, reduce_res=p_sum,
                                    dtype=p_dtype)
                l_sum = nisa.scalar_tensor_tensor(data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                                  data1=p_sum)
                m = m_new

                p_t = [nisa.tensor_copy(nisa.nc_transpose(p[:, b0:b0 + nb])) for b0, nb in blocks]
                for o0, os in o_blocks:
                    pv = nl.zeros((hg, os), dtype=nl.float32, buffer=nl.psum)
                    for pt, rec in zip(p_t, recs):
                        pv += nisa.nc_matmul(pt, rec[:, o0:o0 + os])
                    acc[:, o0:o0 + os] = nisa.scalar_tensor_tensor(
                        data=acc[:, o0:o0 + os], op0=nl.multiply, operand0=alpha, op1=nl.add, data1=pv)
            nl.store(out[t, h0:h0 + hg, :], nisa.tensor_scalar(acc, nl.divide, l_sum, dtype=q.dtype))
    return out
