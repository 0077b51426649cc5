"""fp32 rows times a bf16 weight on the CPU's matrix unit (Intel AMX), as fp32:
out[m, v] = sum_d h[m, d] * float(w[v, d]), to fp32 rounding.

Why (README "The LM head read as bf16"): the rows kernel (layers/bf16_rows_gemm.py) halves the bytes
the head reads, but past 8 rows its FMAs are the limit, as the fp32 GEMM's are: at 32 rows the
129,280 x 256 head took ~22 ms of a ~42 ms tiny-V4 decode step. AMX multiplies bf16 tiles into fp32
accumulators (TDPBF16PS: 16 x 16 outputs from 16 x 32 bf16 operands an instruction), an order of
magnitude more products a cycle than 16-wide FMAs. The weight is bf16 already; h is fp32, and
rounding it to bf16 would change the logits. So each h row is split exactly into three bf16 parts,
h = hi + mid + lo (hi = bf16(h), mid = bf16(h - hi), lo = bf16(h - hi - mid): 8 + 8 + 8 significand
bits hold fp32's 24), and every product of a bf16 part with a bf16 weight is exact in fp32. The
kernel accumulates the hi products in one fp32 tile and the mid and lo products in another, then adds
the two: an fp32 dot product of the same values in a fixed order, within the fp32 GEMM's error bound
(tested). Limits of the split: denormal parts are flushed to zero by the unit (a relative error under
2^-100 of the row's scale), and a row holding inf or NaN gives NaN logits.

Layout: the weight is repacked once at load into the unit's operand form, tiles of 16 vocabulary rows
x 32 columns in which each row of the tile holds, for each of the 16 vocabulary rows, two consecutive
columns ([V/16, D/32, 16, 16, 2], `pack_tiles`); a tile is 1 KiB of contiguous memory, read in order.
Each sweep takes up to 16 h rows (one tile of rows) over the whole weight; more rows take more sweeps.
Measured on this machine (examples/bench/bench_bf16_head.py, one thread, 129,280 x 256): see
layers/head_gemm.py. Two measured traps: without a software prefetch of every line of the tile 64
tiles ahead the unit waits on memory and computes in turn (5.1 ms against 4.1 at 16 rows), and two
row tiles a sweep (reading the weight once for 32 rows) was slower than two sweeps (14 against 8 ms),
as the unit then waits to reuse an operand tile.

The unit is used only where the CPU lists amx_tile and amx_bf16, the compiler builds the source, the
kernel grants the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and a self-check against
the fp32 GEMM passes; otherwise `available()` is False and callers use the rows kernel or the GEMM.
The custom op `deepinfer::bf16_tiles_gemm` has a fake, so compiled regions call it.
"""
from __future__ import annotations

import ctypes
import logging
import threading

import torch

from deepinfer.model_executor.layers.c_kernel_build import cpu_flags, load_gemm_kernel

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AHEAD 64   /* weight tiles ahead of the one read that a step asks the L2 cache for */
#ifndef SPAN_BYTES
#define SPAN_BYTES (256 << 10)   /* the weight a span holds: read by every row tile while it sits in L2 */
#endif

/* the process may use the tile registers once the kernel has granted it their state: 0 when it has */
int amx_permission(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static inline uint16_t to_bf16(float x) {   /* round to nearest even (finite x) */
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* h = hi + mid + lo exactly: each remainder is exact in fp32, and 3 x 8 significand bits hold 24 */
static void split3(const float *h, uint16_t *hi, uint16_t *mid, uint16_t *lo, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = to_bf16(h[i]);
        float r = h[i] - from_bf16(a);
        uint16_t b = to_bf16(r);
        hi[i] = a;
        mid[i] = b;
        lo[i] = to_bf16(r - from_bf16(b));
    }
}

/* The argmax of a row, kept while its logits are stored (no second read of the [M, V] output):
   16 lanes, lane j sees the vocabulary ids 16 * vb + j in ascending order and keeps its first
   maximum (strictly greater replaces), a NaN counting as the largest value as torch.argmax counts
   it; a lane's first value is always taken. finish_max then picks the lowest id among the lanes
   holding the row's maximum: the first maximal index of the row, torch.argmax's answer. */
static inline void track_max(float *best, int32_t *best_id, __m512 s, int64_t vb) {
    __m512 b = _mm512_loadu_ps(best);
    __mmask16 take = _mm512_cmp_ps_mask(s, b, _CMP_GT_OQ)
        | (_mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) & (__mmask16)~_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q));
    if (vb == 0) take = 0xFFFF;
    if (!take) return;
    __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(vb * 16)),
                                   _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    _mm512_storeu_ps(best, _mm512_mask_mov_ps(b, take, s));
    _mm512_storeu_si512(best_id, _mm512_mask_mov_epi32(_mm512_loadu_si512(best_id), take, ids));
}

static int64_t finish_max(const float *best, const int32_t *best_id) {
    int any_nan = 0;
    float m = best[0];
    for (int j = 0; j < 16; j++) {
        if (best[j] != best[j]) any_nan = 1;
        else if (best[j] > m || m != m) m = best[j];
    }
    int64_t id = INT64_MAX;
    for (int j = 0; j < 16; j++) {
        int hit = any_nan ? best[j] != best[j] : best[j] == m;
        if (hit && best_id[j] < id) id = best_id[j];
    }
    return id;
}

/* rows (<= 16) h rows from m0 against every weight tile. Tiles: 0 the weight tile, 1 an h part,
   2 the hi accumulator, 3 the mid + lo accumulator (the unit waits to reuse a tile: more rows per
   sweep was slower, module docstring) */
static void sweep(const uint16_t *hi, const uint16_t *mid, const uint16_t *lo, const uint16_t *wt,
                  float *out, int64_t m0, int rows, int64_t V, int64_t D, int64_t vb0, int64_t vb1,
                  float *best, int32_t *best_id) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = t == 0 ? 16 : (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    const int64_t C = D / 32;
    const size_t stride = (size_t)D * 2;
    const uint16_t *ph = hi + m0 * D, *pm = mid + m0 * D, *pl = lo + m0 * D;
    float acc_hi[16 * 16], acc_rest[16 * 16];
    for (int64_t vb = vb0; vb < vb1; vb++) {
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *w = wt + vb * C * 512;
        for (int64_t c = 0; c < C; c++) {
            const char *ahead = (const char *)(w + (c + AHEAD) * 512);   /* past the end: a hint, never a fault */
            for (int q = 0; q < 16; q++) _mm_prefetch(ahead + 64 * q, _MM_HINT_T1);
            _tile_loadd(0, w + c * 512, 64);
            _tile_loadd(1, ph + c * 32, stride);
            _tile_dpbf16ps(2, 1, 0);
            _tile_loadd(1, pm + c * 32, stride);
            _tile_dpbf16ps(3, 1, 0);
            _tile_loadd(1, pl + c * 32, stride);
            _tile_dpbf16ps(3, 1, 0);
        }
        _tile_stored(2, acc_hi, 64);
        _tile_stored(3, acc_rest, 64);
        for (int i = 0; i < rows; i++) {
            __m512 s = _mm512_add_ps(_mm512_loadu_ps(acc_hi + i * 16), _mm512_loadu_ps(acc_rest + i * 16));
            _mm512_storeu_ps(out + (m0 + i) * V + vb * 16, s);
            if (best) track_max(best + (m0 + i) * 16, best_id + (m0 + i) * 16, s, vb);
        }
    }
    _tile_release();
}

/* h [M, D] fp32 row-major; wt the packed weight [V/16, D/32, 16, 16, 2] bf16; out [M, V] fp32;
   ids [M] int64, or NULL: each out row's argmax (track_max). V a multiple of 16, D of 32. One
   thread. Returns 0, 1 for bad arguments, 2 when out of memory. */
int bf16_tiles_gemm_ids(const float *h, const uint16_t *wt, float *out, int64_t *ids, int64_t M, int64_t V,
                        int64_t D) {
    if (D % 32 != 0 || V % 16 != 0 || M < 0 || V < 0) return 1;
    if (M == 0) return 0;
    if (V == 0) return ids ? 1 : 0;   /* an empty row has no argmax */
    uint16_t *parts = malloc(sizeof(uint16_t) * 3 * M * D);
    if (!parts) return 2;
    float *best = NULL;
    int32_t *best_id = NULL;
    if (ids) {
        best = malloc(sizeof(float) * 16 * M);
        best_id = malloc(sizeof(int32_t) * 16 * M);
        if (!best || !best_id) { free(parts); free(best); free(best_id); return 2; }
    }
    split3(h, parts, parts + M * D, parts + 2 * M * D, M * D);
    /* past 16 rows, every row tile reads a span of the weight while it sits in L2 */
    int64_t span = SPAN_BYTES / (D * 32) > 0 ? SPAN_BYTES / (D * 32) : 1;
    if (M <= 16) span = V / 16;
    for (int64_t vb = 0; vb < V / 16; vb += span) {
        int64_t vb1 = vb + span < V / 16 ? vb + span : V / 16;
        for (int64_t m = 0; m < M; m += 16)
            sweep(parts, parts + M * D, parts + 2 * M * D, wt, out, m, M - m < 16 ? (int)(M - m) : 16, V, D, vb, vb1,
                  best, best_id);
    }
    if (ids)
        for (int64_t m = 0; m < M; m++) ids[m] = finish_max(best + m * 16, best_id + m * 16);
    free(parts);
    free(best);
    free(best_id);
    return 0;
}

int bf16_tiles_gemm(const float *h, const uint16_t *wt, float *out, int64_t M, int64_t V, int64_t D) {
    return bf16_tiles_gemm_ids(h, wt, out, NULL, M, V, D);
}
"""

_FLAGS = ["-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-fPIC", "-shared",
          "-fno-strict-aliasing"]
_lock = threading.Lock()
_lib = None          # the loaded library, False once it proved unusable here
ROWS, COLS = 16, 32  # a weight tile: vocabulary rows x columns (V and D must be multiples)


def _self_check() -> bool:
    """The unit gives the fp32 GEMM's values on a small problem (guards a CPU or hypervisor that lists
    the flags but misbehaves)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(17, 64, generator=g)
    w = (torch.randn(48, 64, generator=g) * 0.05).to(torch.bfloat16)
    out = _run(h, pack_tiles(w), 48)
    return torch.allclose(out, h @ w.float().t(), rtol=1e-5, atol=1e-6)


def available() -> bool:
    """Whether the kernel is usable here (building and checking it on first call); False, logged once,
    where the CPU has no AMX or the build, the tile permission or the self-check fails."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = False
            if not {"amx_tile", "amx_bf16"} <= cpu_flags():
                logger.info("bf16 tiles GEMM: this CPU has no AMX (amx_tile, amx_bf16)")
                return False
            lib = load_gemm_kernel("bf16_tiles_gemm", _SOURCE, _FLAGS)
            if lib is None:
                return False
            lib.amx_permission.restype = ctypes.c_int
            lib.bf16_tiles_gemm_ids.restype = ctypes.c_int
            lib.bf16_tiles_gemm_ids.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            if lib.amx_permission() != 0:
                logger.warning("bf16 tiles GEMM: the kernel refused this process the AMX tile state")
                return False
            _lib = lib
            if not _self_check():
                logger.warning("bf16 tiles GEMM: the self-check against the fp32 GEMM failed; not used")
                _lib = False
        return bool(_lib)


def tile_view(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [V, D] seen in the unit's operand form [V/16, D/32, 16, 16, 2], without a copy:
    for each tile of 16 rows x 32 columns, tile row r holds (w[v, 2r], w[v, 2r + 1]) for v = 0..15.
    The kernel needs it contiguous (pack_tiles, or a copy into a buffer of that shape)."""
    v, d = w.shape
    if v % ROWS or d % COLS:
        raise ValueError(f"pack_tiles: expected [V, D] with V a multiple of {ROWS} and D of {COLS}, "
                         f"got {tuple(w.shape)}")
    return w.reshape(v // ROWS, ROWS, d // COLS, COLS // 2, 2).permute(0, 2, 3, 1, 4)


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """tile_view(w), contiguous: the kernel's packed weight."""
    return tile_view(w).contiguous()


def unpack_tiles(wt: torch.Tensor) -> torch.Tensor:
    """pack_tiles' inverse: [V/16, D/32, 16, 16, 2] -> [V, D]."""
    vb, c = wt.shape[:2]
    return wt.permute(0, 3, 1, 2, 4).reshape(vb * ROWS, c * COLS)


def _run(h: torch.Tensor, wt: torch.Tensor, v: int, with_ids: bool = False):
    """out [M, v] fp32, and with_ids its rows' argmax [M] int64 (the first maximal index: track_max)."""
    out = torch.empty(h.shape[0], v, dtype=torch.float32)
    ids = torch.empty(h.shape[0], dtype=torch.int64) if with_ids else None
    if with_ids:
        rc = _lib.bf16_tiles_gemm_ids(h.data_ptr(), wt.data_ptr(), out.data_ptr(), ids.data_ptr(),
                                      h.shape[0], v, h.shape[1])
    else:
        rc = _lib.bf16_tiles_gemm(h.data_ptr(), wt.data_ptr(), out.data_ptr(), h.shape[0], v, h.shape[1])
    if rc:
        raise RuntimeError(f"bf16_tiles_gemm: the kernel refused its arguments (code {rc})")
    return (out, ids) if with_ids else out


def _checked(h: torch.Tensor, wt: torch.Tensor, op: str) -> None:
    if h.dtype != torch.float32 or wt.dtype != torch.bfloat16 or h.device.type != "cpu" or wt.device.type != "cpu":
        raise ValueError(f"{op}: expected fp32 rows and a bf16 weight on the CPU, got "
                         f"{h.dtype} on {h.device} and {wt.dtype} on {wt.device}")
    if (h.dim() != 2 or wt.dim() != 5 or tuple(wt.shape[2:]) != (COLS // 2, ROWS, 2)
            or h.shape[1] != wt.shape[1] * COLS):
        raise ValueError(f"{op}: expected h [M, D] and a packed weight [V/16, D/32, 16, 16, 2], "
                         f"got {tuple(h.shape)} and {tuple(wt.shape)}")
    if not (_lib or available()):   # loaded already: no lock on the per-step path
        raise RuntimeError(f"{op}: the kernel is not usable here (see the log)")


@torch.library.custom_op("deepinfer::bf16_tiles_gemm", mutates_args=())
def bf16_tiles_gemm(h: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """h fp32 [M, D] x wt (pack_tiles of a bf16 [V, D]) -> fp32 [M, V] (module docstring)."""
    _checked(h, wt, "bf16_tiles_gemm")
    return _run(h.contiguous(), wt.contiguous(), wt.shape[0] * ROWS)


@torch.library.custom_op("deepinfer::bf16_tiles_gemm_argmax", mutates_args=())
def bf16_tiles_gemm_argmax(h: torch.Tensor, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16_tiles_gemm's logits [M, V] and each row's argmax [M] int64, found while the logits are
    stored (the first maximal index, NaN as the largest: torch.argmax's answer). Why: at 32 rows a
    greedy step's argmax re-read the 16.5 MB of logits after the head had written them, ~2 ms of a
    ~23 ms compiled tiny-V4 step (README "Compiled CPU decode step")."""
    _checked(h, wt, "bf16_tiles_gemm_argmax")
    if wt.shape[0] == 0:
        raise ValueError("bf16_tiles_gemm_argmax: an empty vocabulary has no argmax")
    return _run(h.contiguous(), wt.contiguous(), wt.shape[0] * ROWS, with_ids=True)


@bf16_tiles_gemm_argmax.register_fake
def _(h, wt):
    return h.new_empty(h.shape[0], wt.shape[0] * ROWS), h.new_empty(h.shape[0], dtype=torch.int64)


@bf16_tiles_gemm.register_fake
def _(h, wt):
    return h.new_empty(h.shape[0], wt.shape[0] * ROWS)
