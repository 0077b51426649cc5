"""What one kernel launch tracks: the current program ids, the on-chip memory live per partition,
the instruction / byte counts a kernel report reads, and each program's engine busy time under the
cost model (cost.py)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import cost
from deepinfer.neuron_ops.nki.interpreter.rules import (PSUM_BANK_BYTES, PSUM_BANKS, SBUF_BYTES_PER_PARTITION,
                                                        require)

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclass
class Stats:
    """Counts over every program instance of one launch."""
    instructions: Counter = field(default_factory=Counter)  # engine -> instructions issued
    dma_bytes_in: int = 0        # HBM -> SBUF
    dma_bytes_out: int = 0       # SBUF -> HBM
    matmul_flops: int = 0        # 2 * K * M * N summed over nc_matmul
    peak_sbuf_bytes: int = 0     # per partition
    peak_psum_banks: int = 0
    predicted_s: float = 0.0     # cost model: the slowest program's time (cost.program_seconds)
    engine_s: dict = field(default_factory=dict)   # that program's per-engine and DMA seconds
    hbm_reads: dict = field(default_factory=dict)  # id(root array) -> (root, bool mask of elements DMAs read)

    def read_mask(self, tensor) -> np.ndarray:
        """bool [tensor.shape]: the elements of HBM tensor `tensor` some DMA of the launch read."""
        root, offset = _root(tensor.data)
        entry = self.hbm_reads.get(id(root))
        if entry is None:
            return np.zeros(tensor.shape, dtype=bool)
        return _strided_like(entry[1], offset, tensor.data).copy()

    def bytes_read(self, tensor) -> int:
        return int(self.read_mask(tensor).sum()) * tensor.dtype.itemsize

    def as_dict(self) -> dict:
        return {"instructions": {e: self.instructions.get(e, 0) for e in ENGINES},
                "dma_bytes_in": self.dma_bytes_in, "dma_bytes_out": self.dma_bytes_out,
                "matmul_flops": self.matmul_flops, "peak_sbuf_bytes": self.peak_sbuf_bytes,
                "peak_psum_banks": self.peak_psum_banks, "predicted_s": self.predicted_s,
                "engine_s": dict(self.engine_s)}


class Launch:
    """State of the launch being run (one at a time; kernels run their program instances in turn)."""

    def __init__(self, grid: tuple[int, ...]):
        self.grid = grid
        self.program = (0,) * len(grid)
        self.stats = Stats()
        self.sbuf_live = 0
        self.psum_live_banks = 0
        self.shared_hbm: list = []   # outputs, shared by every program instance in allocation order
        self.shared_next = 0
        self.busy: dict = {}         # program -> {engine: seconds}
        self.dma: dict = {}          # program -> [bytes, DMA instructions]

    def count(self, engine: str, n: int = 1, cycles: float = 0.0) -> None:
        """n instructions on `engine` costing `cycles` engine cycles in all (cost.py)."""
        self.stats.instructions[engine] += n
        if cycles:
            busy = self.busy.setdefault(self.program, {})
            busy[engine] = busy.get(engine, 0.0) + cost.seconds(engine, cycles)

    def mark_read(self, view: np.ndarray) -> None:
        """Record the HBM elements a DMA read (exactly the view's elements, strides included)."""
        root, offset = _root(view)
        entry = self.stats.hbm_reads.setdefault(id(root), (root, np.zeros(root.size, dtype=bool)))
        _strided_like(entry[1], offset, view)[...] = True

    def count_dma(self, nbytes: int) -> None:
        self.stats.instructions["dma"] += 1
        d = self.dma.setdefault(self.program, [0, 0])
        d[0] += nbytes
        d[1] += 1

    def finish(self) -> None:
        """The launch's predicted time: its slowest program (programs run on their own cores)."""
        programs = set(self.busy) | set(self.dma)
        times = [cost.program_seconds(self.busy.get(p, {}), *self.dma.get(p, (0, 0))) for p in programs]
        if times:
            slowest = max(times, key=lambda t: t["total"])
            self.stats.predicted_s = slowest["total"]
            self.stats.engine_s = {k: v for k, v in slowest.items() if k != "total"}

    def allocate(self, buffer: str, bytes_per_partition: int, what: str) -> int:
        """Account a new on-chip allocation; returns the units to release when it dies."""
        if buffer == "sbuf":
            self.sbuf_live += bytes_per_partition
            require(self.sbuf_live <= SBUF_BYTES_PER_PARTITION, "sbuf-budget",
                    f"{what} brings live SBUF to {self.sbuf_live} bytes per partition")
            self.stats.peak_sbuf_bytes = max(self.stats.peak_sbuf_bytes, self.sbuf_live)
            return bytes_per_partition
        banks = -(-bytes_per_partition // PSUM_BANK_BYTES)
        self.psum_live_banks += banks
        require(self.psum_live_banks <= PSUM_BANKS, "psum-banks",
                f"{what} needs {banks} bank(s); {self.psum_live_banks} would be live")
        self.stats.peak_psum_banks = max(self.stats.peak_psum_banks, self.psum_live_banks)
        return banks

    def release(self, buffer: str, units: int) -> None:
        if buffer == "sbuf":
            self.sbuf_live -= units
        else:
            self.psum_live_banks -= units


def _root(view: np.ndarray):
    """(the array owning a view's memory, the view's first element's offset in it, in elements)."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root, (view.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // view.itemsize


def _strided_like(mask: np.ndarray, offset: int, view: np.ndarray) -> np.ndarray:
    """The elements of flat `mask` (one per root element) that `view` covers, in view's shape."""
    strides = tuple(s // view.itemsize * mask.itemsize for s in view.strides)
    return np.lib.stride_tricks.as_strided(mask[offset:], shape=view.shape, strides=strides)


_current: Optional[Launch] = None
_last_stats: Optional[Stats] = None


def current() -> Launch:
    if _current is None:
        raise RuntimeError("nki interpreter: this call is only valid inside a kernel launched as kernel[grid](...)")
    return _current


def begin(grid: tuple[int, ...]) -> Launch:
    global _current
    if _current is not None:
        raise RuntimeError("nki interpreter: kernel launches do not nest")
    _current = Launch(grid)
    return _current


def end() -> None:
    global _current, _last_stats
    if _current is not None:
        _current.finish()
        _last_stats = _current.stats
    _current = None


def last_stats() -> Optional[Stats]:
    """Counts of the most recent launch (None before any)."""
    return _last_stats
