"""Math operators: each is an object kernels pass to nisa instructions (op=nl.add) and may also call
as an nki.language elementwise function (nl.add(a, b)). `kind` says which engine computes it when
called through nl: arithmetic and bitvec on the Vector Engine, activation functions on the Scalar
Engine (the engine that holds the transcendental tables)."""
from __future__ import annotations

import numpy as np


def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + 0.044715 * x ** 3)))


# nl.<op>(a, b) runs through nki.language's elementwise dispatch, which registers itself here when it
# is imported (language imports this module, not the other way round).
_elementwise = None


def register_elementwise(fn) -> None:
    global _elementwise
    _elementwise = fn


class Op:
    def __init__(self, name: str, fn, kind: str, arity: int):
        self.name, self.fn, self.kind, self.arity = name, fn, kind, arity

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, *args, dtype=None, **kwargs):
        if _elementwise is None:
            raise RuntimeError("nl ops are called through nki.language: import it first")
        return _elementwise(self, args, dtype)


_ARITH = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
    "equal": lambda a, b: (a == b).astype(np.float32), "not_equal": lambda a, b: (a != b).astype(np.float32),
    "greater": lambda a, b: (a > b).astype(np.float32), "less": lambda a, b: (a < b).astype(np.float32),
    "greater_equal": lambda a, b: (a >= b).astype(np.float32), "less_equal": lambda a, b: (a <= b).astype(np.float32),
}
_BITVEC = {
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift, "right_shift": np.right_shift,
}
_ACT = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: np.float32(1.0) / np.sqrt(x),
    "reciprocal": lambda x: np.float32(1.0) / x, "silu": _silu, "sigmoid": _sigmoid, "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, np.float32(0.0)), "gelu_apprx_tanh": _gelu_tanh, "square": np.square,
    "abs": np.abs, "negative": np.negative, "copy": lambda x: x, "identity": lambda x: x,
}

ALL: dict[str, Op] = {}
for _n, _f in _ARITH.items():
    ALL[_n] = Op(_n, _f, "arith", 2)
for _n, _f in _BITVEC.items():
    ALL[_n] = Op(_n, _f, "bitvec", 2)
for _n, _f in _ACT.items():
    ALL[_n] = Op(_n, _f, "act", 1)
ALL["logical_shift_left"] = ALL["left_shift"]
ALL["logical_shift_right"] = ALL["right_shift"]

REDUCIBLE = {"add": np.sum, "multiply": np.prod, "maximum": np.max, "minimum": np.min,
             "max": np.max, "min": np.min, "bitwise_and": np.bitwise_and.reduce, "bitwise_or": np.bitwise_or.reduce}
