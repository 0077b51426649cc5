"""fp32 rows times a bf16 weight, exactly as fp32: out[m, v] = sum_d h[m, d] * float(w[v, d]).

Why (README "Compiled CPU decode step", "The LM head read as bf16"): a checkpoint's LM head is bf16
(docs/model.md §2), and an fp32 engine widens it to fp32, so every decode step reads twice the bytes
the head holds: 132 MB for the 129,280 x 256 tiny head, about 7.5 ms at one row on these CPUs, half a
batch-1 step. Widening a bf16 value to fp32 is exact (a 16-bit shift), so a kernel that reads the bf16
bytes and widens them in registers computes the same products as the fp32 GEMM, accumulates them in
fp32 as it does, and reads half the bytes. Only the summation order differs from MKL's (each output
sums its D products in 16 fp32 lanes, then the lanes as a fixed tree), so results agree with the fp32 GEMM to
fp32 rounding, and an output depends only on its own h row and w row: the same bits whatever the
batch.

torch has no CPU op for fp32 x bf16 -> fp32 (aten::mm.dtype is CUDA only; a bf16 GEMM rounds its
output to bf16, and widening the weight per call is slower than the fp32 GEMM), so the kernel is C,
built once per machine (layers/c_kernel_build.py) and called through ctypes as the custom op
`deepinfer::bf16_rows_gemm` (a fake gives compiled regions its shape). `available()` is False where
the build fails: callers then keep the fp32 weight.

What makes it fast (measured with examples/bench/bench_bf16_head.py): 32 bf16 values widen with one
shift and one mask (the even- and odd-indexed halves of each 32-bit word; the h rows are split the same
way once a call), four weight rows and up to four h rows share a step (16 accumulators in registers),
and a software prefetch 16 rows ahead, without which one thread read about 9 GB/s instead of 17-20.
It runs on one thread (platforms/cpu.py says when it is used). Where the CPU has AMX, the tiles kernel
(layers/bf16_tiles_gemm.py) takes its place: as fast at one row, several times faster past eight.
"""
from __future__ import annotations

import logging
import threading

import torch

from deepinfer.model_executor.layers.c_kernel_build import load_gemm_kernel

logger = logging.getLogger(__name__)

# GCC vector extensions, so the same source compiles where AVX-512 is missing (the compiler splits a
# 64-byte vector into what the machine has). Work split: vocabulary tiles of TILE rows (a tile of a
# 256-wide head is 128 KiB of bf16, kept in L2 while every group of up to 4 rows reads it), four weight
# rows x up to four h rows per inner loop (16 independent accumulators hide the FMA latency).
_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#define TILE 256   /* vocabulary rows every group of h rows reads while they sit in L2 */
#define AHEAD 16   /* weight rows ahead that a step asks the cache for (software prefetch) */
#define CHUNK 32   /* bf16 values a step reads from a weight row: one 64-byte line */

/* 32 bf16 values as two fp32 vectors, exactly: the even-indexed ones (the low half of each 32-bit
   word, shifted up) and the odd-indexed ones (the high half, the low bits cleared) */
static inline void widen32(const uint16_t *p, v16 *even, v16 *odd) {
    u32x16 raw, lo, hi;
    memcpy(&raw, p, sizeof raw);
    lo = raw << 16;
    hi = raw & 0xFFFF0000u;
    memcpy(even, &lo, sizeof lo);
    memcpy(odd, &hi, sizeof hi);
}

/* the 16 lanes summed as a fixed tree (halves added pairwise): the same order every call */
static inline float lanes_sum(v16 a) {
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* one output: the row's 32-value chunks, lane l of a chunk adding even * x_even, then odd * x_odd
   (the order group() adds them in) */
static inline float dot1(const float *xp, const uint16_t *w0, int64_t D) {
    v16 acc = {0}, ev, od, xe, xo;
    for (int64_t d = 0; d < D; d += CHUNK) {
        widen32(w0 + d, &ev, &od);
        memcpy(&xe, xp + d, sizeof xe);
        memcpy(&xo, xp + d + 16, sizeof xo);
        acc += ev * xe;
        acc += od * xo;
    }
    return lanes_sum(acc);
}

/* rows [m0, m0 + MG) x vocabulary rows [v0, v1), four vocabulary rows at a time. MG is a constant
   1..4 at each call site, so the 16 accumulators stay in registers. hp: the h rows with each chunk
   split into its even-indexed, then its odd-indexed values (split_rows), as widen32 pairs them. */
static inline __attribute__((always_inline)) void group(const float *hp, const uint16_t *w, float *out,
                                                         int64_t V, int64_t D, int64_t m0, const int MG,
                                                         int64_t v0, int64_t v1) {
    const float *x0 = hp + m0 * D;
    int64_t v = v0;
    for (; v + 3 < v1; v += 4) {
        v16 acc[4][4] = {{{0}}};
        const uint16_t *wr = w + v * D;
        for (int64_t d = 0; d < D; d += CHUNK) {
            v16 ev[4], od[4];
            for (int j = 0; j < 4; j++) {
                __builtin_prefetch(wr + (j + AHEAD) * D + d);   /* past v1 is harmless: a hint */
                widen32(wr + j * D + d, &ev[j], &od[j]);
            }
            for (int i = 0; i < MG; i++) {
                v16 xe, xo;
                memcpy(&xe, x0 + i * D + d, sizeof xe);
                memcpy(&xo, x0 + i * D + d + 16, sizeof xo);
                for (int j = 0; j < 4; j++) {   /* two FMAs: (ev * xe + od * xo) + acc would be a mul, an FMA and an add */
                    acc[i][j] += ev[j] * xe;
                    acc[i][j] += od[j] * xo;
                }
            }
        }
        for (int i = 0; i < MG; i++)
            for (int j = 0; j < 4; j++) out[(m0 + i) * V + v + j] = lanes_sum(acc[i][j]);
    }
    for (; v < v1; v++)
        for (int i = 0; i < MG; i++) out[(m0 + i) * V + v] = dot1(x0 + i * D, w + v * D, D);
}

static void span(const float *hp, const uint16_t *w, float *out, int64_t M, int64_t V, int64_t D,
                 int64_t v0, int64_t v1) {
    for (int64_t t = v0; t < v1; t += TILE) {
        int64_t t1 = t + TILE < v1 ? t + TILE : v1;
        for (int64_t m = 0; m < M; m += 4) {
            switch (M - m < 4 ? (int)(M - m) : 4) {
            case 1: group(hp, w, out, V, D, m, 1, t, t1); break;
            case 2: group(hp, w, out, V, D, m, 2, t, t1); break;
            case 3: group(hp, w, out, V, D, m, 3, t, t1); break;
            default: group(hp, w, out, V, D, m, 4, t, t1);
            }
        }
    }
}

/* h [M, D] -> hp: each 32-value chunk as its 16 even-indexed values, then its 16 odd-indexed ones */
static void split_rows(const float *h, float *hp, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t d = 0; d < D; d += CHUNK)
            for (int l = 0; l < 16; l++) {
                hp[m * D + d + l] = h[m * D + d + 2 * l];
                hp[m * D + d + 16 + l] = h[m * D + d + 2 * l + 1];
            }
}

/* h [M, D] fp32 and w [V, D] bf16, row-major, D a multiple of 32; out [M, V] fp32. One thread: the
   caller's rank runs one (the platform keeps a bf16 head only then: platforms/cpu.py). Returns 0, 1
   for bad arguments, 2 when out of memory. */
int bf16_rows_gemm(const float *h, const uint16_t *w, float *out, int64_t M, int64_t V, int64_t D) {
    if (D % CHUNK != 0 || M < 0 || V < 0) return 1;
    if (M == 0 || V == 0) return 0;
    float *hp = malloc(sizeof(float) * M * D);
    if (!hp) return 2;
    split_rows(h, hp, M, D);
    span(hp, w, out, M, V, D, 0, V);
    free(hp);
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fPIC", "-shared", "-fno-strict-aliasing"]
_lock = threading.Lock()
_lib = None          # the loaded library, False once a build failed
LANES = 32           # D must be a multiple of this (a 64-byte line of bf16 a step)


def available() -> bool:
    """Whether the kernel is built (building it on first call); False, logged once, if it cannot be."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = load_gemm_kernel("bf16_rows_gemm", _SOURCE, _FLAGS) or False
        return bool(_lib)


@torch.library.custom_op("deepinfer::bf16_rows_gemm", mutates_args=())
def bf16_rows_gemm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h fp32 [M, D] x w bf16 [V, D] -> fp32 [M, V] (module docstring)."""
    if h.dtype != torch.float32 or w.dtype != torch.bfloat16 or h.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"bf16_rows_gemm: expected fp32 rows and a bf16 weight on the CPU, got "
                         f"{h.dtype} on {h.device} and {w.dtype} on {w.device}")
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1] or w.shape[1] % LANES:
        raise ValueError(f"bf16_rows_gemm: expected h [M, D], w [V, D] with D a multiple of {LANES}, "
                         f"got {tuple(h.shape)} and {tuple(w.shape)}")
    if not (_lib or available()):   # loaded already: no lock on the per-step path
        raise RuntimeError("bf16_rows_gemm: the kernel could not be built (see the log)")
    h, w = h.contiguous(), w.contiguous()
    m, d = h.shape
    out = torch.empty(m, w.shape[0], dtype=torch.float32)
    rc = _lib.bf16_rows_gemm(h.data_ptr(), w.data_ptr(), out.data_ptr(), m, w.shape[0], d)
    if rc:
        raise RuntimeError(f"bf16_rows_gemm: the kernel refused its arguments (code {rc})")
    return out


@bf16_rows_gemm.register_fake
def _(h, w):
    return h.new_empty(h.shape[0], w.shape[0])


def exact_bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A row-major bf16 copy of an fp32 weight whose every value is a bf16 value (as a bf16 checkpoint
    tensor widened at load is) and whose rows suit the kernel; None otherwise. Converted once, in
    slices of 64 MiB of fp32, each checked as it is written: no full-size temporaries."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % LANES:
        return None
    copy = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    rows = max(1, (16 << 20) // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        part, dst = weight[start:start + rows], copy[start:start + rows]
        dst.copy_(part)
        if not torch.equal(dst.float(), part):
            return None
    return copy
