"""`nki.isa` (nisa) of the interpreter: the instructions the kernels use, each checked against the
trn2 rules, computed in fp32 as the engines do, and counted on its engine."""
from __future__ import annotations

import numpy as np

from deepinfer.neuron_ops.nki.interpreter import cost, dtypes, ops, state
from deepinfer.neuron_ops.nki.interpreter.registers import (VirtualRegister, oob_mode, register_alloc,  # noqa: F401
                                                            register_load)
from deepinfer.neuron_ops.nki.interpreter.rules import (MATMUL_CONTRACTION_MAX, MATMUL_MOVING_FREE_MAX,
                                                        MATMUL_STATIONARY_FREE_MAX, TRANSPOSE_TENSOR_ENGINE_MAX,
                                                        TRANSPOSE_VECTOR_ENGINE_MAX, require)
from deepinfer.neuron_ops.nki.interpreter.tensor import OutOfBounds, Tensor, check_on_chip, values


class engine:  # noqa: N801 (the NKI name)
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    unknown = "unknown"


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)


def _op(op) -> ops.Op:
    name = getattr(op, "name", None) or getattr(op, "__name__", None)
    if name in ops.ALL:
        return ops.ALL[name]
    raise ValueError(f"nki interpreter: unsupported operator {op!r}")


def _reduce_fn(op):
    name = getattr(op, "name", None) or getattr(op, "__name__", None)
    if name not in ops.REDUCIBLE:
        raise ValueError(f"nki interpreter: unsupported reduction operator {op!r}")
    return name, ops.REDUCIBLE[name]


def _engine(requested: str, default: str, allowed: tuple) -> str:
    e = default if requested in (None, engine.unknown) else requested
    if e not in allowed:
        raise ValueError(f"nki interpreter: this instruction runs on {allowed}, not {e}")
    return e


def _out(like: Tensor, data: np.ndarray, dtype, buffer: str = "sbuf") -> Tensor:
    out = Tensor.allocate(data.shape, dtype or like.dtype, buffer, "result")
    out.data[...] = dtypes.round_to(data, out.dtype)
    return out


def _vector_operand(what: str, data: Tensor, operand):
    """A compile-time scalar or a (P, 1) tile broadcast along the free axes."""
    if isinstance(operand, Tensor):
        check_on_chip(what, operand)
        require(operand.shape[0] == data.shape[0] and int(np.prod(operand.shape[1:])) == 1, "shape",
                f"{what}: operand {operand.shape} must be a scalar or a ({data.shape[0]}, 1) vector")
        return values(operand).reshape((data.shape[0],) + (1,) * (data.ndim - 1))
    return operand


def _arith(op) -> ops.Op:
    name = getattr(op, "name", None)
    require(name in ops.ALL and ops.ALL[name].kind != "bitvec", "shape",
            f"expected an arithmetic operator, got {op!r}")
    return ops.ALL[name]


def scalar_tensor_tensor(*, data, op0, operand0, op1, data1, dtype=None, mask=None, **kwargs):
    """(data <op0> operand0) <op1> data1 in one Vector Engine instruction, operand0 a scalar or a
    (P, 1) vector (a multiply-add per row); computed in fp32 and rounded once to the output dtype."""
    check_on_chip("scalar_tensor_tensor", data, operand0, data1)
    require(data.shape == data1.shape, "shape", f"scalar_tensor_tensor data {data.shape} vs data1 {data1.shape}")
    f0, f1 = _arith(op0), _arith(op1)
    v = _vector_operand("scalar_tensor_tensor operand0", data, operand0)
    y = f1.fn(f0.fn(values(data), np.float32(v) if np.isscalar(v) else v).astype(np.float32), values(data1))
    state.current().count("vector", cycles=cost.elementwise_cycles(
        cost.free_size(data.shape), inputs=2, psum_input="psum" in (data.buffer, data1.buffer)))
    return _out(data, np.asarray(y, dtype=np.float32), dtype or dtypes.promote(data.dtype, data1.dtype))


# --- Tensor Engine --------------------------------------------------------------------------------
def nc_matmul(stationary, moving, *, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              mask=None, **kwargs):
    """stationary.T @ moving: [K, M] x [K, N] -> [M, N] fp32 in PSUM (K on partitions)."""
    check_on_chip("nc_matmul", stationary, moving)
    for name, t in (("stationary", stationary), ("moving", moving)):
        require(t.buffer == "sbuf", "matmul-inputs-sbuf", f"{name} is {t}")
        require(t.dtype in dtypes.MATMUL_DTYPES, "no-fp4-matmul", f"{name} dtype {t.dtype.name}")
        require(t.ndim == 2, "shape", f"nc_matmul {name} must be 2-D [partition, free], got {t.shape}")
    k, m = stationary.shape
    k2, n = moving.shape
    require(k == k2 and k <= MATMUL_CONTRACTION_MAX, "matmul-contraction",
            f"stationary {stationary.shape}, moving {moving.shape}")
    require(m <= MATMUL_STATIONARY_FREE_MAX, "matmul-stationary-free", f"stationary {stationary.shape}")
    require(n <= MATMUL_MOVING_FREE_MAX, "matmul-moving-free", f"moving {moving.shape}")
    launch = state.current()
    launch.count("tensor", cycles=cost.matmul_cycles(stationary, moving))
    launch.stats.matmul_flops += 2 * k * m * n
    out = _out(stationary, values(stationary).T @ values(moving), dtypes.float32, "psum")
    out.from_matmul = True
    return out


def nc_transpose(data, *, engine=engine.unknown, mask=None, **kwargs):
    """[P, F] -> [F, P]: on the Tensor Engine (<= 128 x 128, into PSUM) or the Vector Engine (<= 32 x 32)."""
    check_on_chip("nc_transpose", data)
    require(data.ndim == 2, "shape", f"nc_transpose takes a 2-D tile, got {data.shape}")
    p, f = data.shape
    small = p <= TRANSPOSE_VECTOR_ENGINE_MAX and f <= TRANSPOSE_VECTOR_ENGINE_MAX
    e = _engine(engine, "vector" if small else "tensor", ("tensor", "vector"))
    limit = TRANSPOSE_TENSOR_ENGINE_MAX if e == "tensor" else TRANSPOSE_VECTOR_ENGINE_MAX
    require(p <= limit and f <= limit, "transpose-size", f"{e} engine transpose of {data.shape}")
    state.current().count(e, cycles=cost.tensor_transpose_cycles(data.shape) if e == "tensor"
                          else cost.elementwise_cycles(f))
    return _out(data, values(data).T, data.dtype, "psum" if e == "tensor" else "sbuf")


# --- Scalar Engine --------------------------------------------------------------------------------
def activation(op, data, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, mask=None,
               dtype=None, **kwargs):
    """op(data * scale + bias) per element (bias, scale: scalars or (P, 1) vectors); with reduce_res,
    also its sum over the free axes into reduce_res (P, 1)."""
    check_on_chip("activation", data, bias, reduce_res)
    fn = _op(op)
    x = values(data) * _vector_operand("activation scale", data, scale)
    if bias is not None:
        x = x + _vector_operand("activation bias", data, bias)
    y = fn.fn(x.astype(np.float32))
    state.current().count("scalar", cycles=cost.elementwise_cycles(cost.free_size(data.shape))
                          + (cost.MIN_II if reduce_res is not None else 0))
    if reduce_res is not None:
        name, red = _reduce_fn(reduce_op if reduce_op is not None else ops.ALL["add"])
        require(name == "add", "shape", "activation's reduction registers only add")
        reduce_res[...] = red(y, axis=tuple(range(1, data.ndim))).reshape(reduce_res.shape)
    return _out(data, y, dtype)


def activation_reduce(op, data, *, reduce_op, reduce_res, bias=None, scale=1.0, mask=None, dtype=None, **kwargs):
    return activation(op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res, dtype=dtype)


# --- Vector Engine --------------------------------------------------------------------------------
def tensor_reduce(op, data, axis, *, mask=None, dtype=None, negate=False, keepdims=False, **kwargs):
    check_on_chip("tensor_reduce", data)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    require(0 not in axes and axes == tuple(range(data.ndim - len(axes), data.ndim)), "shape",
            f"tensor_reduce axes {axes} must be the last free axes of {data.shape}")
    name, red = _reduce_fn(op)
    if name in ("bitwise_and", "bitwise_or"):
        require(not data.dtype.is_float, "bitvec-int", f"tensor_reduce {name} on {data.dtype.name}")
    r = red(values(data), axis=axes, keepdims=keepdims)
    if negate:
        r = -r
    state.current().count("vector", cycles=cost.elementwise_cycles(cost.free_size(data.shape)))
    return _out(data, np.asarray(r), dtype)


def tensor_tensor(data1, data2, op, *, dtype=None, mask=None, engine=engine.unknown, **kwargs):
    check_on_chip("tensor_tensor", data1, data2)
    require(data1.shape == data2.shape, "shape", f"tensor_tensor {data1.shape} vs {data2.shape}")
    fn = _op(op)
    if fn.kind == "bitvec":
        require(not data1.dtype.is_float and not data2.dtype.is_float, "bitvec-int",
                f"tensor_tensor {fn.name} on {data1.dtype.name}, {data2.dtype.name}")
    e = _engine(engine, "vector", ("vector", "gpsimd"))
    n = cost.free_size(data1.shape)
    psum_in = "psum" in (data1.buffer, data2.buffer)
    all_half = all(d in (dtypes.bfloat16, dtypes.float16) for d in (data1.dtype, data2.dtype, dtype or data1.dtype))
    state.current().count(e, cycles=cost.gpsimd_cycles(n) if e == "gpsimd" else cost.elementwise_cycles(
        n, inputs=1 if all_half and fn.name in ("add", "multiply", "subtract") else 2, psum_input=psum_in))
    return _out(data1, fn.fn(values(data1), values(data2)), dtype or dtypes.promote(data1.dtype, data2.dtype))


def tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, *, dtype=None,
                  mask=None, engine=engine.unknown, **kwargs):
    """(data <op0> operand0) <op1> operand1, operands scalars or (P, 1) vectors; bitvec ops on
    integer tiles (bit patterns), arithmetic in fp32."""
    check_on_chip("tensor_scalar", data, operand0, operand1)
    steps = [(op0, operand0, reverse0)] + ([(op1, operand1, reverse1)] if op1 is not None else [])
    fns = [_op(o) for o, _, _ in steps]
    bitvec = [f.kind == "bitvec" for f in fns]
    require(all(bitvec) or not any(bitvec), "bitvec-int", "tensor_scalar mixes bitvec and arithmetic ops")
    if any(bitvec):
        require(not data.dtype.is_float, "bitvec-int", f"tensor_scalar {fns[0].name} on {data.dtype.name}")
        e = _engine(engine, "vector", ("vector",))
    else:
        e = _engine(engine, "vector", ("vector", "scalar", "gpsimd"))
    x = values(data)
    for f, (_, operand, rev) in zip(fns, steps):
        v = _vector_operand("tensor_scalar operand", data, operand)
        x = f.fn(v, x) if rev else f.fn(x, v)
    n = cost.free_size(data.shape)
    state.current().count(e, cycles=cost.gpsimd_cycles(n) if e == "gpsimd" else cost.elementwise_cycles(
        n, speedup=cost.perf_mode_speedup(data, dtype or data.dtype) if e == "vector" else 1))
    return _out(data, x, dtype)


def tensor_copy(src, *, mask=None, dtype=None, engine=engine.unknown, **kwargs):
    check_on_chip("tensor_copy", src)
    e = _engine(engine, "vector", ("vector", "scalar", "gpsimd"))
    n = cost.free_size(src.shape)
    state.current().count(e, cycles=cost.gpsimd_cycles(n) if e == "gpsimd" else cost.elementwise_cycles(
        n, speedup=cost.perf_mode_speedup(src, dtype or src.dtype) if e == "vector" else 1))
    return _out(src, values(src), dtype)


def memset(shape, value, dtype, *, mask=None, engine=engine.unknown, **kwargs):
    e = _engine(engine, "gpsimd", ("vector", "gpsimd"))
    n = cost.free_size(shape)
    state.current().count(e, cycles=cost.gpsimd_cycles(n) if e == "gpsimd" else cost.elementwise_cycles(n))
    out = Tensor.allocate(shape, dtype, "sbuf", "memset")
    out.data[...] = dtypes.round_to(np.full(out.shape, value), dtype)
    return out


# --- DMA ------------------------------------------------------------------------------------------
def dma_copy(*, dst, src, oob_mode=oob_mode.error, dge_mode=None, **kwargs):
    """DMA between HBM and SBUF (either way; src and dst of one shape). Either side may be an HBM
    view at a register offset (a runtime start address); one outside its tensor fails (rule dma-oob)
    unless oob_mode is skip, which issues the DMA and moves nothing."""
    from deepinfer.neuron_ops.nki.interpreter import language
    if isinstance(src, OutOfBounds) or isinstance(dst, OutOfBounds):
        require(oob_mode == "skip", "dma-oob", f"dma_copy {src!r} -> {dst!r}")
        state.current().count_dma(0)
        return
    require(isinstance(src, Tensor) and isinstance(dst, Tensor) and {src.buffer == "sbuf", dst.buffer == "sbuf"}
            == {True, False} and "psum" not in (src.buffer, dst.buffer), "dma-hbm-sbuf",
            f"dma_copy {src!r} -> {dst!r}")
    require(src.shape == dst.shape, "shape", f"dma_copy of {src.shape} into {dst.shape}")
    if dst.buffer == "sbuf":
        dst.data[...] = dtypes.round_to(values(src), dst.dtype)
        language.read_hbm(src)
    else:
        language.write_hbm(dst, src)
