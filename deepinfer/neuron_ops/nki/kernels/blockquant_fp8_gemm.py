"""Blockquant fp8 GEMM for decode shapes: y = x @ W^T, W given as e4m3 code bytes with ue8m0
exponent bytes per block_rows x block_cols block.

Layout the kernel reads (K-major, prepared on the host; see ops.blockquant_fp8_gemm):
  x    [M, Kp]   activations, Kp = K padded to a multiple of 128 with zeros
  w_kn [Kp, N]   uint8 e4m3 codes, K on partitions (the moving operand's layout)
  s_kn [Kp, NB]  uint8 ue8m0 exponents, row k = the scales of W's column k (NB = ceil(N / block_rows))

Tiling: x^T tiles [128, M] are the stationary operand (transposed once on the Tensor Engine); each
weight tile [128, <=512] is dequantized on the Vector Engine into x's dtype (fp8 view of the codes
times 2^(e - 127), one tensor_scalar per N block, the exponent built as fp32 bits by a shift) and
is the moving operand; K tiles accumulate in one fp32 PSUM bank; the grid's program ids split N on
block boundaries (grid 2 = LNC 2)."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

K_TILE = 128   # contraction per matmul (partitions)
N_TILE = 512   # moving free size per matmul (one PSUM bank of fp32)


@nki.jit
def blockquant_fp8_gemm_kernel(x, w_kn, s_kn, block_rows):
    m, kp = x.shape
    n = w_kn.shape[1]
    out = nl.ndarray((m, n), dtype=x.dtype, buffer=nl.shared_hbm)
    programs = nl.num_programs(0)
    share = -(-(-(-n // programs)) // block_rows) * block_rows   # N per program, whole blocks
    n_lo = nl.program_id(0) * share
    n_hi = min(n, n_lo + share)

    x_t = []
    for kt in nl.static_range(kp // K_TILE):
        x_rows = nl.load(x[:, kt * K_TILE:(kt + 1) * K_TILE])
        x_t.append(nl.copy(nisa.nc_transpose(x_rows)))   # PSUM [128, M] -> SBUF

    for n0 in nl.static_range(n_lo, n_hi, N_TILE):
        nt = min(N_TILE, n_hi - n0)
        b_first = n0 // block_rows
        b_count = -(-nt // block_rows)
        acc = nl.zeros((m, nt), dtype=nl.float32, buffer=nl.psum)
        for kt in nl.static_range(kp // K_TILE):
            k0 = kt * K_TILE
            codes = nl.load(w_kn[k0:k0 + K_TILE, n0:n0 + nt])
            exps = nl.load(s_kn[k0:k0 + K_TILE, b_first:b_first + b_count])
            # ue8m0 byte e is the fp32 exponent field of 2^(e - 127)
            scale = nisa.tensor_scalar(exps, nl.left_shift, 23, dtype=nl.int32).view(nl.float32)
            w_fp8 = codes.view(nl.float8_e4m3)
            w = nl.ndarray((K_TILE, nt), dtype=x.dtype, buffer=nl.sbuf)
            for b in nl.static_range(b_count):
                c0, c1 = b * block_rows, min(nt, (b + 1) * block_rows)
                w[:, c0:c1] = nisa.tensor_scalar(w_fp8[:, c0:c1], nl.multiply, scale[:, b:b + 1], dtype=x.dtype)
            acc += nisa.nc_matmul(x_t[kt], w)
        nl.store(out[:, n0:n0 + nt], nl.copy(acc, dtype=x.dtype))
    return out
