"""Blockquant fp8 GEMM for decode shapes: y = x @ W^T, W given as e4m3 code bytes with ue8m0
exponent bytes per block_rows x block_cols block. Two designs:

- `blockquant_fp8_gemm_kernel` (decode, M <= ROWS_TENSOR_DESIGN): the fp8 codes go to the Tensor
  Engine as they are. Why: dequantizing the weight on the Vector Engine costs K x N element work
  per call whatever M is, and at 32-column blocks it is thousands of small instructions (the cost
  model in interpreter/cost.py puts it at ~1.07 ms for 1x1280x36864, the seed measured 1.17 ms),
  while the weight bytes alone take ~0.067 ms. A 32 x 32 scale changes every 32 along K, so it
  cannot be applied once per 128-wide K tile at PSUM evacuation; it is folded into the small
  operand instead: for each N block b, xs_b[k, m] = x[m, k] * s[b, k] (exact: a power of two),
  M x K x N/32 elements, not K x N. The Tensor Engine lays both factors out (x rows once a call,
  `_spread_x`, and each group's scale rows, `_scaled_x`, as stationary operands against 0/1 moving
  ones), so the Vector Engine makes a group's scaled x in one multiply per PSUM bank of K tiles.
  One matmul per K tile and group of g = min(16, 128 / M) N blocks: stationary xs over the group ([128, g*M], rows (block, m)), moving
  the group's fp8 codes ([128, g*32]); PSUM [g*M, g*32] accumulates over K and holds every block's
  scaled x against every block's columns. Evacuating it keeps the diagonal blocks: a 0/1 mask
  multiply (Vector Engine, PSUM -> SBUF) and a matmul with a 0/1 selector that sums the g row blocks
  of each m (exact: one term is non-zero); the Scalar Engine copies the result out and one DMA stores
  a program's columns. DMAs are few and large (a DMA instruction costs 600 ns of descriptor
  generation whatever its size): x once, per group the codes of every K tile in one DMA and the
  group's scale rows in one.
- `blockquant_fp8_gemm_seed_kernel` (a checkpoint-layout weight at M > ROWS_TENSOR_DESIGN, and
  the calibration of the cost model against the seed's measurement; the load-time layout runs the
  tensor design at every M, which the cost model puts ahead at 128 rows too, docs/neuron.md §3.6): each weight tile is dequantized on the Vector Engine into
  x's dtype and is the moving operand, x^T the stationary one (scaled-x work grows with M; the
  dequantization does not).

Layout the kernels read (see ops.blockquant_fp8_gemm):
  x    [M, Kp]   activations, Kp = K padded to a multiple of 128 with zeros (per call: activations)
  seed design (laid out per call from the checkpoint layout: tests and the cost model's calibration):
  w_kn [Kp, N]   uint8 e4m3 codes, K on partitions (the moving operand's layout)
  s_kn [Kp, NB]  uint8 ue8m0 exponents, row k = the scales of W's column k (NB = ceil(N / block_rows))
  tensor design (what the Neuron platform stores at load, model_executor/layers/kernel_layouts.py):
  w_p  [128, Kp/128, N] uint8 e4m3 codes, partition-major: w_p[p, t, n] = W[n, 128 t + p]
  s_bk [NB, Kp]  bf16 scale values 2^(e - 127), each block's K rows (2 bytes per 32 weights of a row
                 block, 1/16 of the code bytes)
  col0, cols     the columns [col0, col0 + cols) of w_p this launch computes (block aligned; cols 0:
                 all), so a grouped GEMM's row groups read the stored weight, not a copy of a slice
  mask [g*M, g*block_rows] bf16: 1 where row block == column block
  sel  [g*M, M]            bf16: 1 where the row's m == the column
  rep_x [M, g*M]           bf16: 1 where the column's m == the row (spreads x rows)
  rep_s [g, g*M]           bf16: 1 where the column's block == the row (spreads scale rows)

Seed design tiling: x^T tiles [128, M] are the stationary operand (transposed once on the Tensor Engine); each
weight tile [128, <=512] is dequantized on the Vector Engine into x's dtype (fp8 view of the codes
times 2^(e - 127), one tensor_scalar per N block, the exponent built as fp32 bits by a shift) and
is the moving operand; K tiles accumulate in one fp32 PSUM bank; the grid's program ids split N on
block boundaries (grid 2 = LNC 2)."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

K_TILE = 128   # contraction per matmul (partitions)
N_TILE = 512   # moving free size per matmul (one PSUM bank of fp32)
ROWS_TENSOR_DESIGN = 8      # M up to which the tensor design runs full 16-block groups


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


def _bank_chunks(kts, w):
    """(first K tile, count) chunks whose w fp32 columns each fit one PSUM bank."""
    per_bank = max(1, N_TILE // w)
    return [(c0, min(per_bank, kts - c0)) for c0 in range(0, kts, per_bank)]


def _spread_x(x_rows, rep_x, g, m, dtype):
    """[128, K tiles, g*M] in x's dtype: xr[k, kt, j*M + i] = x[i, kt*128 + k] for every block j, once
    a call: x rows as the stationary operand against the 0/1 rep_x (transpose and copy in one matmul),
    the Scalar Engine copying each PSUM bank out."""
    kts, w = x_rows.shape[1] // K_TILE, g * m
    xr = nl.ndarray((K_TILE, kts, w), dtype=dtype, buffer=nl.sbuf)
    for c0, cc in _bank_chunks(kts, w):
        bank = nl.ndarray((K_TILE, cc, w), dtype=nl.float32, buffer=nl.psum)
        for i in nl.static_range(cc):
            k0 = (c0 + i) * K_TILE
            bank[:, i, :] = nisa.nc_matmul(x_rows[:, k0:k0 + K_TILE], rep_x[:, 0:w], is_moving_onezero=True)
        xr[:, c0:c0 + cc, :] = nisa.activation(nl.copy, bank, dtype=dtype)
    return xr


def _scaled_x(xr, scales, rep_s, gb, m, dtype):
    """[128, K tiles, gb*M]: xs[k, kt, j*M + i] = x[i, kt*128 + k] * s[b0 + j, kt*128 + k]. The scale
    rows are spread along the free axis by the Tensor Engine (stationary against the 0/1 rep_s), so
    the Vector Engine runs one multiply per PSUM bank of K tiles, not one per (K tile, row) or
    (K tile, block)."""
    kts, w = xr.shape[1], gb * m
    xs = nl.ndarray((K_TILE, kts, w), dtype=dtype, buffer=nl.sbuf)
    for c0, cc in _bank_chunks(kts, w):
        sr = nl.ndarray((K_TILE, cc, w), dtype=nl.float32, buffer=nl.psum)
        for i in nl.static_range(cc):
            k0 = (c0 + i) * K_TILE
            sr[:, i, :] = nisa.nc_matmul(scales[:, k0:k0 + K_TILE], rep_s[0:gb, 0:w], is_moving_onezero=True)
        xs[:, c0:c0 + cc, :] = nisa.tensor_tensor(xr[:, c0:c0 + cc, 0:w], sr, nl.multiply, dtype=dtype)
    return xs


@nki.jit
def blockquant_fp8_gemm_kernel(x_in, w_p, s_bk, mask_in, sel_in, rep_x_in, rep_s_in, block_rows, col0=0, cols=0):
    m, kp = x_in.shape
    kts = w_p.shape[1]
    n = cols or w_p.shape[2]           # the weight's columns [col0, col0 + n) (a row group of it)
    b_col0 = col0 // block_rows        # col0 is on a block boundary
    out = nl.ndarray((m, n), dtype=x_in.dtype, buffer=nl.shared_hbm)
    n_lo, n_hi = _program_share(n, block_rows)
    g = group_blocks(m, block_rows)
    mask, sel = nl.load(mask_in), nl.load(sel_in)
    rep_x, rep_s = nl.load(rep_x_in), nl.load(rep_s_in)
    xr = _spread_x(nl.load(x_in), rep_x, g, m, x_in.dtype)   # x: one DMA [M, Kp], spread once
    y_all = nl.ndarray((m, max(1, n_hi - n_lo)), dtype=x_in.dtype, buffer=nl.sbuf)
    # the diagonal blocks sum exactly (one non-zero term), so a bf16 model rounds them once either way
    diag_dtype = nl.float32 if x_in.dtype == nl.float32 else x_in.dtype
    b_lo, b_hi = n_lo // block_rows, -(-n_hi // block_rows)
    for b0 in nl.static_range(b_lo, b_hi, g):
        gb = min(g, b_hi - b0)
        n0 = b0 * block_rows
        nt = min(gb * block_rows, n_hi - n0)
        scales = nl.load(s_bk[b_col0 + b0:b_col0 + b0 + gb, :])   # [gb, Kp] bf16 scale values: one DMA
        codes = nl.load(w_p[:, :, col0 + n0:col0 + n0 + nt])       # [128, K tiles, nt]: one DMA
        xs = _scaled_x(xr, scales, rep_s, gb, m, x_in.dtype)
        acc = nl.zeros((gb * m, nt), dtype=nl.float32, buffer=nl.psum)
        for kt in nl.static_range(kts):
            acc += nisa.nc_matmul(xs[:, kt, :], codes[:, kt, :].view(nl.float8_e4m3))
        diag = nisa.tensor_tensor(acc, mask[0:gb * m, 0:nt], nl.multiply, dtype=diag_dtype)
        y = nisa.nc_matmul(sel[0:gb * m, 0:m], diag, is_stationary_onezero=True)
        y_all[:, n0 - n_lo:n0 - n_lo + nt] = nisa.activation(nl.copy, y, dtype=x_in.dtype)   # Scalar Engine
    if n_hi > n_lo:
        nl.store(out[:, n_lo:n_hi], y_all)
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
