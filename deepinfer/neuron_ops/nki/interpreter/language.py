"""`nki.language` (nl) of the interpreter: dtypes, buffers, tensor creation, HBM<->SBUF moves,
program ids, loop ranges, index ranges and the elementwise / reduction functions kernels call."""
from __future__ import annotations

import itertools

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import cost, dtypes, ops, state
from deepinfer.neuron_ops.nki.interpreter.dtypes import (bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2,  # noqa: F401
                                                         float16, float32, int8, int16, int32, tfloat32, uint8,
                                                         uint16, uint32)
from deepinfer.neuron_ops.nki.interpreter.rules import (LNC_MAX, MATMUL_MOVING_FREE_MAX, MATMUL_STATIONARY_FREE_MAX,
                                                        PARTITIONS, PSUM_BANK_BYTES, PSUM_BANKS,
                                                        SBUF_BYTES_PER_PARTITION, require)
from deepinfer.neuron_ops.nki.interpreter.registers import dynamic_range  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter.tensor import IndexExpr, OutOfBounds, Tensor, check_on_chip, values

bool_ = uint8

# buffers
sbuf = "sbuf"
psum = "psum"
hbm = "hbm"
shared_hbm = "shared_hbm"
private_hbm = "private_hbm"


class tile_size:  # noqa: N801 (the NKI name)
    pmax = PARTITIONS
    psum_fmax = PSUM_BANK_BYTES // 4
    psum_num_banks = PSUM_BANKS
    gemm_stationary_fmax = MATMUL_STATIONARY_FREE_MAX
    gemm_moving_fmax = MATMUL_MOVING_FREE_MAX
    total_available_sbuf_size = SBUF_BYTES_PER_PARTITION


# --- operators (also callable as elementwise functions) -------------------------------------------
globals().update(ops.ALL)


class _Reduction:
    """nl.sum / nl.max / ...: a reduction over free axes (Vector Engine); also usable as an op."""

    def __init__(self, name: str, fn):
        self.name, self.fn, self.kind = name, fn, "arith"

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, x, axis, *, dtype=None, keepdims=False, mask=None):
        check_on_chip(f"nl.{self.name}", x)
        axes = _free_axes(x, axis)
        state.current().count("vector", cycles=cost.elementwise_cycles(cost.free_size(x.shape)))
        r = self.fn(values(x), axis=axes, keepdims=keepdims)
        return x.like(np.asarray(r), dtype or x.dtype)


def _free_axes(x: Tensor, axis) -> tuple:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if 0 in axes:
        raise ValueError("nki interpreter: reductions run over free axes; axis 0 is the partition axis")
    return axes


sum = _Reduction("sum", np.sum)  # noqa: A001 (the NKI name)
max = _Reduction("max", np.max)  # noqa: A001
min = _Reduction("min", np.min)  # noqa: A001
prod = _Reduction("prod", np.prod)
mean = _Reduction("mean", np.mean)


def elementwise(op, args, dtype):
    """nl.<op>(a[, b]): tiles of one partition count, or a (P, 1) vector / scalar broadcast on free axes."""
    require(len(args) == op.arity, "shape", f"nl.{op.name} takes {op.arity} operand(s), got {len(args)}")
    check_on_chip(f"nl.{op.name}", *args)
    tiles = [a for a in args if isinstance(a, Tensor)]
    if not tiles:
        raise TypeError(f"nl.{op.name}: at least one operand must be a tile")
    shape = np.broadcast_shapes(*[t.shape for t in tiles])
    for t in tiles:
        require(t.shape[0] == shape[0], "shape", f"nl.{op.name}: partition sizes {[t.shape for t in tiles]}")
    if op.kind == "bitvec":
        require(all(not t.dtype.is_float for t in tiles), "bitvec-int", f"nl.{op.name} on {[t.dtype for t in tiles]}")
    n = cost.free_size(shape)
    state.current().count("scalar" if op.kind == "act" else "vector",
                          cycles=cost.elementwise_cycles(n, inputs=len(tiles), psum_input=any(
                              t.buffer == "psum" for t in tiles)))
    out = op.fn(*[values(a) for a in args])
    return tiles[0].like(np.broadcast_to(out, shape), dtype or dtypes.promote(*[t.dtype for t in tiles]))


ops.register_elementwise(elementwise)


def where(condition, x, y, *, dtype=None, mask=None, **kwargs):
    """x where condition is non-zero, else y (a Vector Engine select); condition and x are tiles of
    one shape, y a tile of that shape or a scalar, e.g. -inf for masked entries."""
    check_on_chip("nl.where", condition, x, y)
    require(isinstance(condition, Tensor) and isinstance(x, Tensor), "shape",
            "nl.where takes a condition tile and a value tile x")
    require(condition.shape == x.shape, "shape", f"nl.where condition {condition.shape} vs x {x.shape}")
    if isinstance(y, Tensor):
        require(y.shape == x.shape, "shape", f"nl.where x {x.shape} vs y {y.shape}")
    state.current().count("vector", cycles=cost.elementwise_cycles(cost.free_size(x.shape), inputs=2))
    out_dtype = dtype or (dtypes.promote(x.dtype, y.dtype) if isinstance(y, Tensor) else x.dtype)
    return x.like(np.where(values(condition) != 0, values(x), values(y)), out_dtype)


def copy(x, dtype=None):
    """A tile copy (Vector Engine), e.g. PSUM -> SBUF, with an optional dtype conversion."""
    check_on_chip("nl.copy", x)
    state.current().count("vector", cycles=cost.elementwise_cycles(
        cost.free_size(x.shape), speedup=cost.perf_mode_speedup(x, dtype or x.dtype)))
    return x.like(values(x), dtype or x.dtype)


def broadcast_to(src, *, shape):
    check_on_chip("nl.broadcast_to", src)
    shape = tuple(shape)
    require(shape[0] <= PARTITIONS, "partition-dim", f"broadcast_to {shape}")
    state.current().count("vector", cycles=cost.elementwise_cycles(cost.free_size(shape)))
    return src.like(np.broadcast_to(values(src), shape), src.dtype)


# --- tensor creation and data movement ------------------------------------------------------------
def ndarray(shape, dtype, *, buffer=sbuf, name=""):
    if buffer == shared_hbm:
        return _shared_output(tuple(shape), dtype)
    return Tensor.allocate(shape, dtype, buffer, name or "ndarray")


def zeros(shape, dtype, *, buffer=sbuf, name=""):
    """A zero-filled tile (a memset, issued on the GpSimd engine)."""
    t = ndarray(shape, dtype, buffer=buffer, name=name or "zeros")
    if t.on_chip:
        state.current().count("gpsimd", cycles=cost.gpsimd_cycles(cost.free_size(t.shape)))
    return t


def _shared_output(shape, dtype) -> Tensor:
    """A kernel output in shared HBM: every program instance of the launch gets the same tensor."""
    launch = state.current()
    k = launch.shared_next
    launch.shared_next += 1
    if k < len(launch.shared_hbm):
        t = launch.shared_hbm[k]
        if t.shape != shape or t.dtype is not dtype:
            raise RuntimeError("nki interpreter: program instances allocate different shared_hbm outputs")
        return t
    t = Tensor.allocate(shape, dtype, shared_hbm)
    launch.shared_hbm.append(t)
    return t


def load(src, *, mask=None, dtype=None):
    """DMA HBM -> SBUF: a new SBUF tile holding `src` (optionally converted to `dtype`)."""
    if mask is not None:
        raise NotImplementedError("nki interpreter: masks are not supported; slice instead")
    require(not isinstance(src, OutOfBounds), "dma-oob", f"nl.load of {src!r}")
    require(isinstance(src, Tensor) and not src.on_chip, "dma-hbm-sbuf",
            f"nl.load reads HBM, got {src!r}")
    out = Tensor.allocate(src.shape, dtype or src.dtype, sbuf, "load")
    out.data[...] = dtypes.round_to(values(src), out.dtype)
    out.fresh_load = True
    read_hbm(src)
    return out


def read_hbm(src: Tensor) -> None:
    """Account one DMA reading HBM view `src`: its bytes, one DMA instruction, the elements read."""
    launch = state.current()
    launch.count_dma(src.data.size * src.dtype.itemsize)
    launch.stats.dma_bytes_in += src.data.size * src.dtype.itemsize
    launch.mark_read(src.data)


def store(dst, value, *, mask=None):
    """DMA SBUF -> HBM: write `value` into the HBM tensor view `dst` (converted to dst's dtype)."""
    if mask is not None:
        raise NotImplementedError("nki interpreter: masks are not supported; slice instead")
    require(not isinstance(dst, OutOfBounds), "dma-oob", f"nl.store into {dst!r}")
    require(isinstance(dst, Tensor) and not dst.on_chip, "dma-hbm-sbuf", f"nl.store writes HBM, got {dst!r}")
    require(isinstance(value, Tensor) and value.buffer == sbuf, "dma-hbm-sbuf",
            f"nl.store reads SBUF, got {value!r} (copy PSUM to SBUF first)")
    require(value.shape == dst.shape, "shape", f"nl.store of {value.shape} into {dst.shape}")
    write_hbm(dst, value)


def write_hbm(dst: Tensor, value: Tensor) -> None:
    """One DMA writing SBUF tile `value` into HBM view `dst` (converted to dst's dtype)."""
    dst.data[...] = dtypes.round_to(values(value), dst.dtype)
    launch = state.current()
    launch.count_dma(dst.data.size * dst.dtype.itemsize)
    launch.stats.dma_bytes_out += dst.data.size * dst.dtype.itemsize


# --- SPMD and loops -------------------------------------------------------------------------------
class nc:  # noqa: N801 (the NKI name)
    """A grid dimension spread over the physical cores of a logical core (LNC): nl.nc(2) on trn2."""

    def __init__(self, n: int):
        require(1 <= n <= LNC_MAX, "lnc", f"nl.nc({n})")
        self.n = n

    def __int__(self) -> int:
        return self.n


def program_id(axis: int = 0) -> int:
    return state.current().program[axis]


def num_programs(axes: int = 0) -> int:
    return state.current().grid[axes]


def program_ndim() -> int:
    return len(state.current().grid)


def affine_range(*args, **kwargs):
    return range(*args)


def sequential_range(*args, **kwargs):
    return range(*args)


def static_range(*args, **kwargs):
    return range(*args)


def arange(*args) -> IndexExpr:
    return IndexExpr(np.arange(*args))


class _MGrid:
    def __getitem__(self, slices):
        return tuple(IndexExpr(g) for g in np.mgrid[slices])


mgrid = _MGrid()


def grid_points(grid: tuple[int, ...]):
    return itertools.product(*[range(g) for g in grid])
