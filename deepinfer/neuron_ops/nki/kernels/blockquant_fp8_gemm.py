"""Blockquant fp8 GEMM for decode shapes: y = x @ W^T, W given as e4m3 code bytes with ue8m0
exponent bytes per block_rows x block_cols block. Two designs:

- `blockquant_fp8_gemm_kernel` (decode, M <= ROWS_TENSOR_DESIGN): the fp8 codes go to the Tensor
  Engine as they are. Why: dequantizing the weight on the Vector Engine costs K x N element work
  per call whatever M is, and at 32-column blocks it is thousands of small instructions (the cost
  model in interpreter/cost.py puts it at ~1.07 ms for 1x1280x36864, the seed measured 1.17 ms),
  while the weight bytes alone take ~0.067 ms. A 32 x 32 scale changes every 32 along K, so it
  cannot be applied once per 128-wide K tile at PSUM evacuation; it is folded into the small
  operand instead: for each N block b, x^T scaled by the block's K-row scales, xs_b[k, m] =
  x[m, k] * s[k, b], is exact (a power of two) and costs M x K/128 x N/32 elements, not K x N.
  One matmul per K tile and group of g = min(16, 128 / M) N blocks: stationary xs over the group
  ([128, g*M], rows (block, m)), moving the group's fp8 codes ([128, g*32]); PSUM [g*M, g*32]
  accumulates over K and holds every block's scaled x against every block's columns. Evacuating
  it keeps the diagonal blocks: a 0/1 mask multiply (Vector Engine, PSUM -> SBUF fp32) and a
  matmul with a 0/1 selector that sums the g row blocks of each m (exact: one term is non-zero).
  The g-fold redundant TensorE work is cheap at M <= 8: g*32 moving columns cost what 512 cost.
- `blockquant_fp8_gemm_seed_kernel` (M > ROWS_TENSOR_DESIGN, and the calibration of the cost
  model against the seed's measurement): each weight tile is dequantized on the Vector Engine into
  x's dtype and is the moving operand, x^T the stationary one (scaled-x work grows with M; the
  dequantization does not).

Layout the kernels read (K-major, prepared on the host; see ops.blockquant_fp8_gemm):
  x    [M, Kp]   activations, Kp = K padded to a multiple of 128 with zeros
  w_kn [Kp, N]   uint8 e4m3 codes, K on partitions (the moving operand's layout)
  s_kn [Kp, NB]  uint8 ue8m0 exponents, row k = the scales of W's column k (NB = ceil(N / block_rows))
  mask [g*M, g*block_rows] bf16 (tensor design): 1 where row block == column block
  sel  [g*M, M]            bf16 (tensor design): 1 where the row's m == the column

Seed design tiling: x^T tiles [128, M] are the stationary operand (transposed once on the Tensor Engine); each
weight tile [128, <=512] is dequantized on the Vector Engine into x's dtype (fp8 view of the codes
times 2^(e - 127), one tensor_scalar per N block, the exponent built as fp32 bits by a shift) and
is the moving operand; K tiles accumulate in one fp32 PSUM bank; the grid's program ids split N on
block boundaries (grid 2 = LNC 2)."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

K_TILE = 128   # contraction per matmul (partitions)
N_TILE = 512   # moving free size per matmul (one PSUM bank of fp32)
ROWS_TENSOR_DESIGN = 8      # M up to which the tensor design runs full 16-block groups
XS_BYTES = 64 * 1024        # SBUF per partition for the scaled x^T tiles of one N chunk


def group_blocks(m: int, block_rows: int) -> int:
    """N blocks per matmul in the tensor design: g*M stationary columns <= 128, g*block_rows moving <= 512."""
    return max(1, min(N_TILE // block_rows, 128 // m))


def _program_share(n, block_rows):
    programs = nl.num_programs(0)
    share = -(-(-(-n // programs)) // block_rows) * block_rows   # N per program, whole blocks
    n_lo = nl.program_id(0) * share
    return n_lo, min(n, n_lo + share)


def _x_transposed(x, kp):
    x_t = []
    for kt in nl.static_range(kp // K_TILE):
        x_rows = nl.load(x[:, kt * K_TILE:(kt + 1) * K_TILE])
        x_t.append(nl.copy(nisa.nc_transpose(x_rows)))   # PSUM [128, M] -> SBUF
    return x_t


def _scaled_x(x_t, s_kn, b0, nb, m, dtype):
    """Per K tile, xs[k, j*M + i] = x[i, k] * 2^(s[k, b0 + j] - 127) for the chunk's nb blocks."""
    xs = []
    for kt in nl.static_range(len(x_t)):
        k0 = kt * K_TILE
        exps = nl.load(s_kn[k0:k0 + K_TILE, b0:b0 + nb])
        scale = nisa.tensor_scalar(exps, nl.left_shift, 23, dtype=nl.int32).view(nl.float32)
        t = nl.ndarray((K_TILE, nb * m), dtype=dtype, buffer=nl.sbuf)
        for i in nl.static_range(m):
            t[:, i::m] = nisa.tensor_scalar(scale, nl.multiply, x_t[kt][:, i:i + 1], dtype=dtype)
        xs.append(t)
    return xs


@nki.jit
def blockquant_fp8_gemm_kernel(x, w_kn, s_kn, mask_in, sel_in, block_rows):
    m, kp = x.shape
    n = w_kn.shape[1]
    out = nl.ndarray((m, n), dtype=x.dtype, buffer=nl.shared_hbm)
    n_lo, n_hi = _program_share(n, block_rows)
    g = group_blocks(m, block_rows)
    mask = nl.load(mask_in)
    sel = nl.load(sel_in)
    x_t = _x_transposed(x, kp)
    itemsize = 4 if x.dtype == nl.float32 else 2
    chunk = max(g, XS_BYTES // (len(x_t) * m * itemsize) // g * g)   # blocks per scaled-x chunk
    b_lo, b_hi = n_lo // block_rows, -(-n_hi // block_rows)
    for c0 in nl.static_range(b_lo, b_hi, chunk):
        cb = min(chunk, b_hi - c0)
        xs = _scaled_x(x_t, s_kn, c0, cb, m, x.dtype)
        for j0 in nl.static_range(0, cb, g):
            gb = min(g, cb - j0)
            n0 = (c0 + j0) * block_rows
            nt = min(gb * block_rows, n_hi - n0)
            acc = nl.zeros((gb * m, nt), dtype=nl.float32, buffer=nl.psum)
            for kt in nl.static_range(len(x_t)):
                codes = nl.load(w_kn[kt * K_TILE:(kt + 1) * K_TILE, n0:n0 + nt])
                acc += nisa.nc_matmul(xs[kt][:, j0 * m:(j0 + gb) * m], codes.view(nl.float8_e4m3))
            diag = nisa.tensor_tensor(acc, mask[0:gb * m, 0:nt], nl.multiply, dtype=nl.float32)
            y = nisa.nc_matmul(sel[0:gb * m, 0:m], diag, is_stationary_onezero=True)
            nl.store(out[:, n0:n0 + nt], nl.copy(y, dtype=x.dtype))
    return out


@nki.jit
def blockquant_fp8_gemm_seed_kernel(x, w_kn, s_kn, block_rows):
    m, kp = x.shape
    n = w_kn.shape[1]
    out = nl.ndarray((m, n), dtype=x.dtype, buffer=nl.shared_hbm)
    n_lo, n_hi = _program_share(n, block_rows)
    x_t = _x_transposed(x, kp)

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
