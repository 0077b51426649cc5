"""Blockquant fp4 GEMM for decode shapes: y = x @ W^T, W given as e2m1 nibble pairs (element 2j in
the low nibble of byte j) with one ue8m0 exponent byte per `group` consecutive K elements of a row.

Design note. trn2 has no fp4 (or integer) matmul datapath, so each weight tile is decoded once into
the matmul's input format: x's dtype (bf16 for bf16 activations; fp32 for fp32 ones, as the reference
computes), with its 1x32 scale applied in the same pass, and is then the moving operand of both
nibble halves' matmuls for every activation row. Decoding to fp8 instead would not remove the decode
and would need a second rounding; folding the scale into x as the fp8 kernel does would not either
(the scale changes along N and every 32 along K; the codes still need decoding). The decode is the
kernel's bound (docs/neuron.md section 3.7), so it is spread over three engines (`decode_spread`): the
Vector Engine only does what only it does (the bit extractions, which take integer tiles, and the
final scaled product), the Scalar Engine the one-tile arithmetic, GpSimd the two-tile adds; every
intermediate is a small integer, a half or a signed power of two, so bf16 holds it exactly and the
decoded weights equal the one-engine fp32 decode (`decode_e2m1`, design "vector") bit for bit.

Layout the kernel reads (prepared by ops.blockquant_fp4_gemm; the weight bytes are the checkpoint's,
transposed K-major):
  x_lo, x_hi [M, K/2]  the even / odd K columns of x (byte row j of W pairs x[:, 2j] and x[:, 2j+1])
  w_t        [K/2, N]  uint8 nibble pairs, packed K on partitions
  s_t        [K/g, N]  uint8 ue8m0 exponents, row r = the scales of K elements [r*g, (r+1)*g)
  (w_t and s_t are what the Neuron platform stores at load, model_executor/layers/kernel_layouts.py:
  the checkpoint's bytes, transposed, 1.00x their bytes)
  onehot     [128, T, 128] bf16: onehot[r, j, p] = onehot_value(design) where byte row p of the j-th
             K tile of a chunk is in scale row r of the chunk (T = 128 / (256/g) K tiles a chunk)
The scales of 128 scale rows (T K tiles) are loaded in one DMA per N tile and turned into bf16
values by one shift (the exponent byte is bf16's exponent field); each K tile's matmul against its
one-hot slice picks its rows out of the chunk (the zero rows add nothing).
Nibbles map to values without a table: for the magnitude code c in 0..7, e2m1 is
0.5*c + 0.5*relu(c - 4) + relu(c - 6) (0, .5, 1, 1.5, 2, 3, 4, 6), times -1 when bit 3 is set: small
integers and halves, exact in any float format. The scales vary along K (partitions) in steps of g/2
byte rows; the Tensor Engine spreads them onto the partitions (onehot^T @ scales, exact for powers of
two) instead of the host storing one scale byte per weight byte, or a scale value per 32 weights.
Tiling: x^T tiles [<=128, <=128 rows] stationary (two per K tile: even and odd columns; up to
ROWS_MAX rows a launch in chunks of 128, each decoded weight tile used by every chunk), decoded
weight tiles [<=128, <=512] moving, fp32 PSUM accumulation over K, grid 2 splits N (LNC 2)."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl
from deepinfer.neuron_ops.nki.kernels.fp4_word_decode import NIBBLE_SCALE, decode_words

K_ROWS = 128   # packed byte rows (= 256 K elements) per K tile
PARTITIONS = 128
N_TILE = 512   # moving free size per matmul (one PSUM bank of fp32)


def decode_e2m1(codes, dtype):
    """uint8/int32 nibble codes (0..15) [P, F] -> their e2m1 values as an fp32 tile (Vector Engine)."""
    mag = nisa.tensor_scalar(codes, nl.bitwise_and, 7, dtype=nl.float32)
    sign_bit = nisa.tensor_scalar(codes, nl.right_shift, 3, dtype=nl.float32)
    sign = nisa.tensor_scalar(sign_bit, nl.multiply, -2.0, op1=nl.add, operand1=1.0)
    over4 = nisa.tensor_scalar(mag, nl.subtract, 4.0, op1=nl.maximum, operand1=0.0)
    over6 = nisa.tensor_scalar(mag, nl.subtract, 6.0, op1=nl.maximum, operand1=0.0)
    v = nisa.tensor_tensor(mag, over4, nl.add)
    v = nisa.tensor_scalar(v, nl.multiply, 0.5)
    v = nisa.tensor_tensor(v, over6, nl.add)
    return nisa.tensor_tensor(v, sign, nl.multiply, dtype=dtype)


# (magnitude, sign) bit extractions of the low and the high nibble of a byte: (op0, operand0, op1, operand1)
_NIBBLE_FIELDS = (((nl.bitwise_and, 7, None, None), (nl.right_shift, 3, nl.bitwise_and, 1)),
                  ((nl.right_shift, 4, nl.bitwise_and, 7), (nl.right_shift, 7, None, None)))


def decode_spread(packed, scale_rows, dtype):
    """Both nibble halves of a byte tile as weights in `dtype`, times their scales (scale_rows, PSUM):
    for the magnitude code m (0..7) and sign bit s, 2|v| = m + relu(m - 4) + 2 [m == 7] and
    v * scale = 2|v| * (0.5 - s) * scale."""
    half = nl.bfloat16
    out = []
    for (m0, a0, m1, a1), (s0, b0, s1, b1) in _NIBBLE_FIELDS:
        mag = nisa.tensor_scalar(packed, m0, a0, op1=m1, operand1=a1, dtype=half)
        neg = nisa.tensor_scalar(packed, s0, b0, op1=s1, operand1=b1, dtype=half)
        over4 = nisa.tensor_scalar(mag, nl.subtract, 4.0, op1=nl.maximum, operand1=0.0, dtype=half,
                                   engine=nisa.scalar_engine)
        top = nisa.tensor_scalar(mag, nl.equal, 7.0, op1=nl.multiply, operand1=2.0, dtype=half,
                                 engine=nisa.scalar_engine)
        half_sign = nisa.tensor_scalar(neg, nl.multiply, -1.0, op1=nl.add, operand1=0.5, dtype=half,
                                       engine=nisa.scalar_engine)
        twice = nisa.tensor_tensor(nisa.tensor_tensor(mag, over4, nl.add, dtype=half, engine=nisa.gpsimd_engine),
                                   top, nl.add, dtype=half, engine=nisa.gpsimd_engine)
        signed_scale = nisa.tensor_tensor(half_sign, scale_rows, nl.multiply, dtype=half, engine=nisa.gpsimd_engine)
        out.append(nisa.tensor_tensor(twice, signed_scale, nl.multiply, dtype=dtype))
    return out


ROW_CHUNK = 128   # activation rows per x^T tile (the stationary free size)
ROWS_MAX = 512    # rows a launch: 4 row chunks' fp32 accumulators (a PSUM bank each) + the scale rows


def transpose_halves(lo_rows, hi_rows, kb):
    """x^T tiles of the even / odd columns: lists of SBUF [<=128, M] per K tile (Tensor Engine)."""
    lo_t, hi_t = [], []
    for k0 in nl.static_range(0, kb, K_ROWS):
        kr = min(K_ROWS, kb - k0)
        # PSUM -> SBUF on the Scalar Engine: the Vector Engine is the decode's bound
        lo_t.append(nisa.activation(nl.copy, nisa.nc_transpose(lo_rows[:, k0:k0 + kr])))
        hi_t.append(nisa.activation(nl.copy, nisa.nc_transpose(hi_rows[:, k0:k0 + kr])))
    return lo_t, hi_t


def row_chunks(x_lo, x_hi, kb):
    """The rows of HBM x_lo / x_hi [M, kb] in chunks of <= ROW_CHUNK: (r0, r1, lo_t, hi_t) each, so
    one decoded weight tile serves every chunk (the decode is the kernel's cost, not the matmuls)."""
    m = x_lo.shape[0]
    out = []
    for r0 in nl.static_range(0, m, ROW_CHUNK):
        r1 = min(m, r0 + ROW_CHUNK)
        out.append((r0, r1) + transpose_halves(nl.load(x_lo[r0:r1]), nl.load(x_hi[r0:r1]), kb))
    return out


DESIGNS = ("words", "spread", "vector")


def onehot_value(design: str) -> float:
    """What the one-hot scale-spreading matrix holds: 2^6 for the e4m3 word decode (its codes are the
    nibbles' values times 2^-6, kernels/fp4_word_decode.py), else 1."""
    return NIBBLE_SCALE if design == "words" else 1.0


def fp4_tile_matmul(chunks, w_t, s_t, onehot, group, n0, nt, dtype, design="words"):
    """Per row chunk of `chunks` (row_chunks), PSUM [rows, nt] fp32 = x @ W[n0:n0+nt]^T over every K
    tile, each weight tile decoded once (into `dtype`) for all chunks; design
    "words" (decode_words: e4m3 codes by integer ops on 32-bit words; needs nt % 4 == 0 and the
    one-hot at onehot_value("words")), "spread" (decode_spread) or "vector" (decode_e2m1 on the
    Vector Engine alone, the seed's way)."""
    kb = w_t.shape[0]
    rows_per_scale = group // 2
    tiles_per_chunk = onehot.shape[1]   # K tiles whose scale rows share one 128-partition chunk
    accs = [nl.zeros((r1 - r0, nt), dtype=nl.float32, buffer=nl.psum) for r0, r1, _, _ in chunks]
    for kt in nl.static_range(len(chunks[0][2])):
        k0 = kt * K_ROWS
        kr = min(K_ROWS, kb - k0)
        packed = nl.load(w_t[k0:k0 + kr, n0:n0 + nt])
        j = kt % tiles_per_chunk
        if j == 0:   # the next chunk of scale rows: one DMA, one shift into bf16 values
            c0 = kt * K_ROWS // rows_per_scale
            c1 = min(s_t.shape[0], c0 + PARTITIONS)
            exps = nl.load(s_t[c0:c1, n0:n0 + nt])
            # ue8m0 byte e is the bf16 exponent field of 2^(e - 127): bits e << 7
            scales = nisa.tensor_scalar(exps, nl.left_shift, 7, dtype=nl.uint16).view(nl.bfloat16)
        rows = scales.shape[0]
        scale_rows = nisa.nc_matmul(onehot[0:rows, j, 0:kr], scales)     # PSUM [kr, nt]: row p = its scale
        if design == "words":
            w_lo, w_hi = decode_words(packed, scale_rows, dtype)
        elif design == "spread":
            w_lo, w_hi = decode_spread(packed, scale_rows, dtype)
        else:
            lo = nisa.tensor_scalar(packed, nl.bitwise_and, 15, dtype=nl.int32)
            hi = nisa.tensor_scalar(packed, nl.right_shift, 4, dtype=nl.int32)
            w_lo = nisa.tensor_tensor(decode_e2m1(lo, nl.float32), scale_rows, nl.multiply, dtype=dtype)
            w_hi = nisa.tensor_tensor(decode_e2m1(hi, nl.float32), scale_rows, nl.multiply, dtype=dtype)
        for acc, (_, _, lo_t, hi_t) in zip(accs, chunks):
            acc += nisa.nc_matmul(lo_t[kt], w_lo)
            acc += nisa.nc_matmul(hi_t[kt], w_hi)
    return accs


@nki.jit
def blockquant_fp4_gemm_kernel(x_lo, x_hi, w_t, s_t, onehot_in, group, design="words"):
    m, kb = x_lo.shape
    n = w_t.shape[1]
    out = nl.ndarray((m, n), dtype=x_lo.dtype, buffer=nl.shared_hbm)
    share = -(-n // nl.num_programs(0))
    n_lo = nl.program_id(0) * share
    n_hi = min(n, n_lo + share)
    onehot = nl.load(onehot_in)
    chunks = row_chunks(x_lo, x_hi, kb)
    for n0 in nl.static_range(n_lo, n_hi, N_TILE):
        nt = min(N_TILE, n_hi - n0)
        accs = fp4_tile_matmul(chunks, w_t, s_t, onehot, group, n0, nt, x_lo.dtype, design)
        for acc, (r0, r1, _, _) in zip(accs, chunks):
            nl.store(out[r0:r1, n0:n0 + nt], nisa.activation(nl.copy, acc, dtype=x_lo.dtype))
    return out
