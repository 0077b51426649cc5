"""What one kernel launch tracks: the current program ids, the on-chip memory live per partition,
and the instruction / byte counts a kernel report reads."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

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

    def as_dict(self) -> dict:
        return {"instructions": {e: self.instructions.get(e, 0) for e in ENGINES},
                "dma_bytes_in": self.dma_bytes_in, "dma_bytes_out": self.dma_bytes_out,
                "matmul_flops": self.matmul_flops, "peak_sbuf_bytes": self.peak_sbuf_bytes,
                "peak_psum_banks": self.peak_psum_banks}


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

    def count(self, engine: str, n: int = 1) -> None:
        self.stats.instructions[engine] += n

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
        _last_stats = _current.stats
    _current = None


def last_stats() -> Optional[Stats]:
    """Counts of the most recent launch (None before any)."""
    return _last_stats
