"""`nki.jit` of the interpreter: `kernel[grid](*args)` runs the kernel once per program id (in
order), with HBM tensors for NumPy / torch inputs, and returns the kernel's outputs."""
from __future__ import annotations

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import dtypes, language, state
from deepinfer.neuron_ops.nki.interpreter.tensor import Tensor


def _grid(grid) -> tuple[int, ...]:
    dims = grid if isinstance(grid, tuple) else (grid,)
    return tuple(int(d) for d in dims)  # nl.nc(n) checked its own n when made


def _hbm_arg(a):
    if isinstance(a, Tensor):
        return a
    if isinstance(a, np.ndarray):
        return Tensor.hbm(a)
    return a  # Python scalars and other compile-time constants


class _Launcher:
    def __init__(self, kernel: "Kernel", grid: tuple[int, ...]):
        self.kernel, self.grid = kernel, grid

    def __call__(self, *args, **kwargs):
        args = [_hbm_arg(a) for a in args]
        kwargs = {k: _hbm_arg(v) for k, v in kwargs.items()}
        launch = state.begin(self.grid)
        try:
            result = None
            for point in language.grid_points(self.grid):
                launch.program = point
                launch.shared_next = 0
                r = self.kernel.fn(*args, **kwargs)
                result = r if result is None else result
        finally:
            state.end()
        self.kernel.last_stats = state.last_stats()
        return result


class Kernel:
    """A jitted kernel function; kernel[grid] picks the launch grid (default: one program)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = fn.__doc__
        self.last_stats = None

    def __getitem__(self, grid) -> _Launcher:
        return _Launcher(self, _grid(grid))

    def __call__(self, *args, **kwargs):
        return _Launcher(self, (1,))(*args, **kwargs)


def jit(fn=None, **options):
    """@nki.jit or @nki.jit(...): options (mode, platform target) do not change the interpretation."""
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def hbm(values: np.ndarray, dtype: dtypes.DType | None = None) -> Tensor:
    """An HBM input tensor of dtype `dtype` (e.g. bf16 values passed as float32)."""
    return Tensor.hbm(values, dtype)
