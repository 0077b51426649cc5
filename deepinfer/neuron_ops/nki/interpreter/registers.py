"""Runtime values of the interpreter: virtual registers (`nisa.register_alloc`, `register_load`),
the loops they bound (`nl.dynamic_range`) and the DMA start offsets they give (an HBM tensor indexed
by a register, `nisa.dma_copy` with `oob_mode`).

A register's value exists only on the device: the kernel is traced once, so a register can bound a
hardware loop or offset a DMA, never steer Python control flow or become a Python int (rule
`register-host`). The interpreter holds the value (`_value`) to run the kernel, and refuses the
conversions a traced kernel could not make."""
from __future__ import annotations

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import cost, dtypes, state
from deepinfer.neuron_ops.nki.interpreter.rules import require


class VirtualRegister:
    """One engine register holding a 32-bit integer the device computed."""

    def __init__(self, value: int = 0):
        self._value = int(value)

    def _refuse(self, *_):
        require(False, "register-host", "a VirtualRegister used as a Python value (bool / int / range / index)")

    __bool__ = __int__ = __index__ = __float__ = _refuse

    def __repr__(self) -> str:
        return "VirtualRegister(<device value>)"


def register_alloc(init: int | None = None) -> VirtualRegister:
    require(init is None or isinstance(init, int), "register-host", f"register_alloc initial value {init!r}")
    return VirtualRegister(init or 0)


def register_load(reg: VirtualRegister, src) -> None:
    """reg = the int32 value of a 1x1 SBUF tile (one engine instruction; not documented as costed,
    charged one ScalarE instruction of MIN_II cycles)."""
    require(isinstance(reg, VirtualRegister), "register-load", f"register_load into {reg!r}")
    require(getattr(src, "buffer", None) == "sbuf" and src.dtype is dtypes.int32
            and int(np.prod(src.shape)) == 1, "register-load", f"register_load from {src!r}")
    reg._value = int(src.data.reshape(-1)[0])
    state.current().count("scalar", cycles=cost.MIN_II)


def dynamic_range(start, stop=None, step: int = 1):
    """A hardware loop with runtime bounds (ints or registers); the body gets the iteration
    register. The step must be a compile-time positive int."""
    require(isinstance(step, int) and not isinstance(step, bool) and step > 0, "dynamic-range-step",
            f"nl.dynamic_range step {step!r}")
    if stop is None:
        start, stop = 0, start
    lo, hi = (b._value if isinstance(b, VirtualRegister) else int(b) for b in (start, stop))
    for i in range(lo, hi, step):
        yield VirtualRegister(i)


def resolve_index(idx):
    """An index with registers replaced by their values: (index, dynamic?)."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    dynamic = any(isinstance(i, VirtualRegister) for i in parts)
    if not dynamic:
        return idx, False
    require(isinstance(parts[0], VirtualRegister) and not any(isinstance(i, VirtualRegister) for i in parts[1:]),
            "dynamic-offset", f"index {parts}: a register offsets the outermost axis only")
    return (parts[0]._value,) + tuple(parts[1:]), True


class oob_mode:  # noqa: N801 (the NKI name)
    error = "error"
    skip = "skip"
