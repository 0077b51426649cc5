"""Tensors of the interpreter: an HBM tensor or an on-chip (SBUF / PSUM) tile over a NumPy array.

Axis 0 of an on-chip tile is the partition axis. Slicing gives a view of the same storage (and the
same allocation: a view keeps its tile alive). An on-chip allocation is charged to the launch's
per-partition budget when made and released when the last view of it is garbage-collected, which in
CPython is as soon as the kernel drops its last name for it (the tile's lifetime in the kernel).
"""
from __future__ import annotations

import weakref

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import cost, dtypes, registers, state
from deepinfer.neuron_ops.nki.interpreter.rules import PARTITIONS, require

HBM_BUFFERS = ("hbm", "shared_hbm", "private_hbm")
ON_CHIP = ("sbuf", "psum")


class _Allocation:
    """One on-chip allocation; releases its per-partition bytes (or PSUM banks) when collected."""

    def __init__(self, buffer: str, shape: tuple, dtype: dtypes.DType, what: str):
        per_partition = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if len(shape) > 1 else dtype.itemsize
        launch = state.current()
        units = launch.allocate(buffer, per_partition, what)
        weakref.finalize(self, launch.release, buffer, units)


class IndexExpr:
    """An index vector from nl.arange / nl.mgrid, with the affine arithmetic kernels apply to it."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, dtype=np.int64)

    def __getitem__(self, idx):
        return IndexExpr(self.values[idx])

    def __add__(self, o):
        return IndexExpr(self.values + _ival(o))

    __radd__ = __add__

    def __sub__(self, o):
        return IndexExpr(self.values - _ival(o))

    def __mul__(self, o):
        return IndexExpr(self.values * _ival(o))

    __rmul__ = __mul__

    def as_slice(self) -> slice:
        """The contiguous range this index covers (the interpreter supports unit-stride ranges)."""
        v = self.values
        axes = [a for a in range(v.ndim) if v.shape[a] > 1]
        if len(axes) > 1:
            raise NotImplementedError("nki interpreter: an index expression must vary along one axis")
        line = v.reshape(-1) if not axes else np.moveaxis(v, axes[0], 0).reshape(v.shape[axes[0]], -1)[:, 0]
        start = int(line[0])
        if not np.array_equal(line, np.arange(start, start + len(line))):
            raise NotImplementedError("nki interpreter: only unit-stride index ranges are supported")
        return slice(start, start + len(line))


def _ival(o):
    return o.values if isinstance(o, IndexExpr) else o


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _normalize_index(idx):
    if not isinstance(idx, tuple):
        idx = (idx,)
    return tuple(i.as_slice() if isinstance(i, IndexExpr) else i for i in idx)


class Tensor:
    """An NKI tensor (HBM) or tile (SBUF / PSUM): a NumPy view plus dtype, buffer and allocation."""

    def __init__(self, data: np.ndarray, dtype: dtypes.DType, buffer: str, alloc=None):
        self.data = data
        self.dtype = dtype
        self.buffer = buffer
        self._alloc = alloc
        self.from_matmul = False   # a fresh nc_matmul result (may only accumulate into fp32 PSUM)
        self.fresh_load = False    # a fresh nl.load result (may not be copied into PSUM: no HBM->PSUM)
        self.dynamic = False       # an HBM view at a register offset (a DMA with a runtime start address)

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def allocate(cls, shape, dtype: dtypes.DType, buffer: str, what: str = "tile") -> "Tensor":
        shape = tuple(int(s) for s in shape)
        if buffer in HBM_BUFFERS:
            return cls(np.zeros(shape, dtype.storage), dtype, buffer)
        if buffer not in ON_CHIP:
            raise ValueError(f"nki interpreter: unknown buffer {buffer!r}")
        require(len(shape) >= 1 and shape[0] <= PARTITIONS, "partition-dim",
                f"{buffer} {what} of shape {shape}")
        alloc = _Allocation(buffer, shape, dtype, f"{buffer} {what} {shape} {dtype.name}")
        return cls(np.zeros(shape, dtype.storage), dtype, buffer, alloc)

    @classmethod
    def hbm(cls, values: np.ndarray, dtype: dtypes.DType | None = None) -> "Tensor":
        """An HBM input holding `values` (rounded to `dtype`; default: the NumPy type's NKI dtype)."""
        dtype = dtype or dtypes.from_numpy(values.dtype)
        return cls(dtypes.round_to(np.asarray(values), dtype), dtype, "shared_hbm")

    def like(self, data: np.ndarray, dtype: dtypes.DType) -> "Tensor":
        """A new on-chip tile of this tile's partition count holding `data` as `dtype`."""
        out = Tensor.allocate(data.shape, dtype, "sbuf", "result")
        out.data[...] = dtypes.round_to(data, dtype)
        return out

    # --- shape ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def on_chip(self) -> bool:
        return self.buffer in ON_CHIP

    def __repr__(self) -> str:
        return f"Tensor({self.buffer}, {self.shape}, {self.dtype.name})"

    def __getitem__(self, idx):
        idx, dynamic = registers.resolve_index(idx)
        if dynamic:
            require(not self.on_chip, "dynamic-offset", f"register offset into on-chip tile {self}")
            if not 0 <= idx[0] < self.shape[0]:
                return OutOfBounds(self, idx[0])
        view = self.data[_normalize_index(idx)]
        if view.ndim == 0:
            view = view.reshape(1)
        out = Tensor(view, self.dtype, self.buffer, self._alloc)
        out.dynamic = dynamic or self.dynamic
        return out

    def __setitem__(self, idx, value) -> None:
        target = self.data[_normalize_index(idx)]
        if isinstance(value, Tensor):
            if _same_view(value.data, target):
                return  # `t[...] += x` writes t's own view back
            require(self.on_chip, "dma-hbm-sbuf", f"assignment into an HBM tensor {self}; use nl.store")
            require(value.on_chip, "dma-hbm-sbuf", f"assignment of HBM tensor {value} into {self}; use nl.load")
            require(not (self.buffer == "psum" and value.fresh_load), "dma-hbm-sbuf",
                    f"a load from HBM written into PSUM tile {self}")
            require(not (value.from_matmul and (self.buffer != "psum" or self.dtype is not dtypes.float32)),
                    "matmul-output-fp32-psum", f"nc_matmul result written into {self}")
            src = value.data
        else:
            require(self.on_chip, "compute-on-chip", f"assignment into an HBM tensor {self}")
            src = value
        target[...] = dtypes.round_to(np.broadcast_to(src, target.shape), self.dtype)

    def __iadd__(self, other):
        """PSUM accumulation (`acc += nisa.nc_matmul(...)`) or a Vector Engine add in place."""
        require(self.on_chip, "compute-on-chip", f"in-place add into HBM tensor {self}")
        if isinstance(other, Tensor):
            require(other.on_chip, "compute-on-chip", f"in-place add of HBM tensor {other}")
            if other.from_matmul:
                require(self.buffer == "psum" and self.dtype is dtypes.float32, "matmul-output-fp32-psum",
                        f"nc_matmul result accumulated into {self}")
            else:
                state.current().count("vector", cycles=_add_cycles(self, other))
            src = other.data
        else:
            state.current().count("vector", cycles=_add_cycles(self, None))
            src = other
        acc = self.data.astype(np.float32) + np.broadcast_to(src, self.shape).astype(np.float32)
        self.data[...] = dtypes.round_to(acc, self.dtype)
        return self

    def view(self, dtype: dtypes.DType) -> "Tensor":
        """The same bytes read as another dtype (a bit reinterpretation). Between item sizes the last
        axis changes length by their ratio (a [P, F] uint8 tile is a [P, F/4] uint32 one), bytes in
        little-endian order as on the device: byte 4j of a row is the low byte of word j."""
        bits = dtypes.to_bits(self.data, self.dtype)
        if dtype.itemsize != self.dtype.itemsize:
            row_bytes = self.shape[-1] * self.dtype.itemsize
            if row_bytes % dtype.itemsize:
                raise ValueError(f"view: a last axis of {row_bytes} bytes is not whole {dtype.name} items")
            raw = np.ascontiguousarray(bits).astype(bits.dtype.newbyteorder("<")).view(np.uint8)
            bits = raw.view(np.dtype(dtype.bits).newbyteorder("<")).astype(dtype.bits)
        values = dtypes.from_bits(bits, dtype)
        return Tensor(values, dtype, self.buffer, self._alloc)

    def numpy(self) -> np.ndarray:
        return self.data.copy()


class OutOfBounds:
    """An HBM view whose register offset lies outside its tensor: a DMA from or to it fails (rule
    dma-oob) unless `nisa.dma_copy(..., oob_mode=oob_mode.skip)` skips the transfer."""

    def __init__(self, tensor: Tensor, index: int):
        self.tensor, self.index = tensor, index
        self.on_chip, self.buffer, self.dynamic = False, tensor.buffer, True

    def __getitem__(self, idx):
        return self

    def __repr__(self) -> str:
        return f"OutOfBounds({self.tensor}, index {self.index})"


def _add_cycles(acc: "Tensor", other) -> float:
    two = isinstance(other, Tensor)
    return cost.elementwise_cycles(cost.free_size(acc.shape), inputs=2 if two else 1,
                                   psum_input="psum" in (acc.buffer, other.buffer if two else ""))


def values(x) -> np.ndarray:
    """An operand's values as fp32 (engines compute in fp32) or, for integer tiles, int64."""
    if isinstance(x, Tensor):
        return x.data.astype(np.float32) if x.dtype.is_float else x.data.astype(np.int64)
    return np.asarray(x)


def check_on_chip(what: str, *operands) -> None:
    for o in operands:
        if isinstance(o, Tensor):
            require(o.on_chip, "compute-on-chip", f"{what} got HBM tensor {o}")
