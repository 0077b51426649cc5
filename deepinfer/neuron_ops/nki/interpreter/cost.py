"""A time model of a kernel launch on trn2 (ESTIMATE): every instruction the interpreter runs is
charged its documented cost on its engine, and a launch's predicted time is read off the busiest
engine. Constants and their sources: docs/neuron.md section 1.1 (the cost-model table).

Per-instruction costs (engine cycles, N = elements per partition of the input tile, P = partitions):
- VectorE / ScalarE: max(MIN_II, N) for one input tile, max(MIN_II, 2N) for two SBUF inputs
  (tensor_tensor, scalar_tensor_tensor), max(MIN_II, N) when one of two inputs is in PSUM; bf16/fp16
  tensor_scalar / tensor_copy with both tiles in SBUF run 4x faster, 2x with one tile in PSUM
  (trn2 performance mode); plus a static 100 cycles when N < 128 (back-to-back small instructions).
- GpSimd: 150 cycles of start-up + N.
- TensorE: nc_matmul max(min(64, N_stationary), N_moving), 4x for an fp32 operand; nc_transpose
  max(P, min(64, F)).
- DMA: bytes at the HBM bandwidth of one physical core; each DMA instruction also takes 600 ns of
  descriptor generation on one of a core's 2 DGE instances.

Overlap: the engines and the DMA queues of a core run concurrently (the compiler inserts the
semaphores and the kernels' tiles pipeline), so a program's time is the largest of its per-engine
busy times and its DMA time; the programs of an LNC = 2 grid run on their own physical cores at
once, so a launch takes its slowest program. No fixed launch cost is added (none is documented); a
measured time includes one, so predictions run low by it.
"""
from __future__ import annotations

from deepinfer.neuron_ops.nki.interpreter import dtypes

CLOCK_HZ = {"tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9}
MIN_II = 64                         # minimum initiation interval of a VectorE / ScalarE instruction
SMALL_STATIC_CYCLES = 100           # added to a VectorE / ScalarE instruction with N < 128
SMALL_N = 128
GPSIMD_START_CYCLES = 150
MATMUL_MIN_CYCLES = 64              # TensorE instruction turnaround
FP32_MATMUL_FACTOR = 4
HBM_BYTES_PER_S_PER_CORE = 2.9e12 / 8   # a chip's HBM bandwidth over its 8 physical cores
DMA_FIXED_S = 600e-9                # one DGE-issued DMA instruction
DGE_PER_CORE = 2

_HALF = (dtypes.bfloat16, dtypes.float16)


def free_size(shape) -> int:
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n


def _small(n: int) -> int:
    return SMALL_STATIC_CYCLES if n < SMALL_N else 0


def elementwise_cycles(n: int, *, inputs: int = 1, psum_input: bool = False, speedup: int = 1) -> float:
    """A VectorE / ScalarE instruction over N elements a partition (see the module docstring)."""
    per_element = 1 if inputs == 1 or psum_input else 2
    return max(MIN_II, per_element * n / speedup) + _small(n)


def perf_mode_speedup(src, out_dtype, out_buffer: str = "sbuf") -> int:
    """trn2 VectorE performance mode for tensor_scalar / tensor_copy: 4x with 16-bit float input and
    output both in SBUF, 2x with one of them in PSUM, else 1x."""
    if src.dtype not in _HALF or out_dtype not in _HALF:
        return 1
    return 4 if src.buffer == "sbuf" and out_buffer == "sbuf" else 2


def gpsimd_cycles(n: int) -> float:
    return GPSIMD_START_CYCLES + n


def matmul_cycles(stationary, moving) -> float:
    c = max(min(MATMUL_MIN_CYCLES, free_size(stationary.shape)), free_size(moving.shape))
    if dtypes.float32 in (stationary.dtype, moving.dtype):
        c *= FP32_MATMUL_FACTOR
    return c


def tensor_transpose_cycles(shape) -> float:
    return max(int(shape[0]), min(MATMUL_MIN_CYCLES, free_size(shape)))


def seconds(engine: str, cycles: float) -> float:
    return cycles / CLOCK_HZ[engine]


def dma_seconds(nbytes: int, count: int) -> float:
    """A program's DMA time: the bytes at one core's HBM share, or the descriptor issue of its DMA
    instructions, whichever is longer (the two pipeline)."""
    return max(nbytes / HBM_BYTES_PER_S_PER_CORE, count * DMA_FIXED_S / DGE_PER_CORE)


def program_seconds(busy: dict, dma_bytes: int, dma_count: int) -> dict:
    """Per-engine busy seconds of one program, its DMA seconds and the program's time (the max)."""
    out = {e: busy.get(e, 0.0) for e in CLOCK_HZ}
    out["dma"] = dma_seconds(dma_bytes, dma_count)
    out["total"] = max(out.values())
    return out
