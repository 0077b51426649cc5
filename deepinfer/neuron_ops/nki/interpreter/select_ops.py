"""Instructions added for the attention, indexer and mHC kernels (phase 2b of issue 14), kept apart
from language.py / isa.py, which re-export them:

- `nl.where(condition, x, y)`: a Vector Engine select (NKI 0.x `nki.language.where`); `y` may be a
  tile or a scalar, e.g. -inf for masked entries;
- `nisa.scalar_tensor_tensor(data=, op0=, operand0=, op1=, data1=)`: (data op0 operand0) op1 data1
  in one Vector Engine instruction, operand0 a scalar or a (P, 1) vector (a multiply-add per row).
"""
from __future__ import annotations

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import dtypes, ops, state
from deepinfer.neuron_ops.nki.interpreter.rules import require
from deepinfer.neuron_ops.nki.interpreter.tensor import Tensor, check_on_chip, values


def _result(data: np.ndarray, dtype: dtypes.DType) -> Tensor:
    out = Tensor.allocate(data.shape, dtype, "sbuf", "result")
    out.data[...] = dtypes.round_to(data, dtype)
    return out


def _arith(op) -> ops.Op:
    name = getattr(op, "name", None)
    require(name in ops.ALL and ops.ALL[name].kind != "bitvec", "shape",
            f"expected an arithmetic operator, got {op!r}")
    return ops.ALL[name]


def where(condition, x, y, *, dtype=None, mask=None, **kwargs):
    """x where condition is non-zero, else y; condition and x are tiles of one shape."""
    check_on_chip("nl.where", condition, x, y)
    require(isinstance(condition, Tensor) and isinstance(x, Tensor), "shape",
            "nl.where takes a condition tile and a value tile x")
    require(condition.shape == x.shape, "shape", f"nl.where condition {condition.shape} vs x {x.shape}")
    if isinstance(y, Tensor):
        require(y.shape == x.shape, "shape", f"nl.where x {x.shape} vs y {y.shape}")
    state.current().count("vector")
    out_dtype = dtype or (dtypes.promote(x.dtype, y.dtype) if isinstance(y, Tensor) else x.dtype)
    return _result(np.where(values(condition) != 0, values(x), values(y)), out_dtype)


def scalar_tensor_tensor(*, data, op0, operand0, op1, data1, dtype=None, mask=None, **kwargs):
    """(data <op0> operand0) <op1> data1, computed in fp32 and rounded once to the output dtype."""
    check_on_chip("scalar_tensor_tensor", data, operand0, data1)
    require(data.shape == data1.shape, "shape", f"scalar_tensor_tensor data {data.shape} vs data1 {data1.shape}")
    f0, f1 = _arith(op0), _arith(op1)
    v = operand0
    if isinstance(operand0, Tensor):
        require(operand0.shape[0] == data.shape[0] and int(np.prod(operand0.shape[1:])) == 1, "shape",
                f"scalar_tensor_tensor operand0 {operand0.shape} must be a scalar or a ({data.shape[0]}, 1) vector")
        v = values(operand0).reshape((data.shape[0],) + (1,) * (data.ndim - 1))
    y = f1.fn(f0.fn(values(data), np.float32(v) if np.isscalar(v) else v).astype(np.float32), values(data1))
    state.current().count("vector")
    return _result(np.asarray(y, dtype=np.float32), dtype or dtypes.promote(data.dtype, data1.dtype))
