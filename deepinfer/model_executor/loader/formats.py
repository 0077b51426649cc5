"""Which format a stored tensor is in (fp8 block, packed fp4, dense, integer), the dense shape it
decodes to, and the checks of a found shape against the expected one (docs/model.md §2.1);
`stored_formats`: what weight_format="packed" keeps as stored, from the file headers."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from deepinfer.model_executor.checkpoint_formats import is_engram_table, is_fp32_tensor
from deepinfer.model_executor.layers.quant import infer_block_size
from deepinfer.model_executor.loader.names import bind_scales, canonical_names
from deepinfer.model_executor.loader.scan import Stored, block_hint, dtype_name, scan

ENGRAM_ROW_ALIGN = 256  # DI pads Engram tables to a multiple of 256 rows (engram_parameters.py)

EXPERT_STACK = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")   # transformers' stacked experts


def storage_kind(name: str, st: Stored, scale: Stored | None, exp_dtype: torch.dtype) -> str:
    """Storage format, or ValueError when dtype and scale do not fit together."""
    want = f"expected dtype {dtype_name(exp_dtype)}, found {st.describe()}"
    if st.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError(f"tensor {name!r}: float8_e4m3fn weight without a scale (.scale or .weight_scale_inv); "
                             f"{want}")
        kind = "fp8"
    elif st.dtype in (torch.int8, torch.uint8) and (exp_dtype.is_floating_point or exp_dtype == torch.uint8):
        if scale is None:
            raise ValueError(f"tensor {name!r}: packed fp4 (int8) weight without a scale; {want}")
        kind = "fp4"
    elif st.dtype.is_floating_point:
        if scale is not None:
            raise ValueError(f"tensor {name!r}: has a scale {scale.key!r} but is not fp8/fp4; {want}")
        if st.dtype == torch.float8_e8m0fnu:
            raise ValueError(f"tensor {name!r}: ue8m0 is a scale format, not a weight; {want}")
        kind = "dense"
    else:
        kind = "int"
    if exp_dtype == torch.uint8:   # the model keeps this weight packed (layers/packed_weights.py)
        if kind not in ("fp8", "fp4"):
            raise ValueError(f"tensor {name!r}: the model keeps it packed (weight_format='packed') but the "
                             f"checkpoint stores it unquantized, {st.describe()}; use weight_format='dense'")
        return kind
    if (kind == "int") == exp_dtype.is_floating_point:
        raise ValueError(f"tensor {name!r}: {want}")
    if scale is not None and scale.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32,
                                                 torch.bfloat16, torch.float16):
        raise ValueError(f"tensor {name!r}: scale {scale.key!r} has dtype {dtype_name(scale.dtype)}; "
                         "expected float8_e8m0fnu, uint8 or a float dtype")
    if is_fp32_tensor(name) and st.dtype != torch.float32:
        raise ValueError(f"tensor {name!r}: must be stored as float32 (docs/model.md §2.1); {want}")
    return kind


def dense_shape(name: str, st: Stored, scale: Stored | None, kind: str, hint) -> tuple:
    """The dense shape a stored tensor decodes to (after checking its scale grid)."""
    if kind == "fp8":
        if len(st.shape) < 2:
            raise ValueError(f"tensor {name!r}: fp8 weight must be >= 2-D, found {st.describe()}")
        try:
            infer_block_size(st.shape, scale.shape, hint)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: scale {scale.key!r} shape {scale.shape} does not fit "
                             f"{st.describe()}: {e}") from None
        return st.shape
    if kind == "fp4":
        cols = 2 * st.shape[-1] if st.shape else 0
        ok = (len(st.shape) >= 2 and len(scale.shape) == len(st.shape) and scale.shape[:-1] == st.shape[:-1]
              and scale.shape[-1] > 0 and cols % scale.shape[-1] == 0)
        if not ok:
            raise ValueError(f"tensor {name!r}: fp4 scale {scale.key!r} shape {scale.shape} does not fit packed "
                             f"{st.describe()}; expected [.., rows, cols / group]")
        return (*st.shape[:-1], cols)
    return st.shape


def check_shape(name: str, found: tuple, exp_shape: tuple, exp_dtype: torch.dtype, st: Stored) -> None:
    if tuple(found) != tuple(exp_shape):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} dtype {dtype_name(exp_dtype)}, "
                         f"found {st.describe()} (dense shape {tuple(found)})")


def engram_rows(name: str, found: tuple, exp_shape: tuple, exp_dtype, st: Stored) -> Callable:
    """Cut or zero-pad an Engram table to the model's rows (docs/model.md §2.1, §2.2)."""
    rows, want = found[0], exp_shape[0]
    if len(found) != 2 or found[1] != exp_shape[1] or (rows > want and rows > -(-want // ENGRAM_ROW_ALIGN)
                                                      * ENGRAM_ROW_ALIGN):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} (rows may be padded to a multiple "
                         f"of {ENGRAM_ROW_ALIGN}) dtype {dtype_name(exp_dtype)}, found {st.describe()}")

    def fix(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] >= want:
            return t[:want]
        return torch.cat([t, t.new_zeros(want - t.shape[0], t.shape[1])])

    return fix


def dense_of_packed(codes_shape: tuple, kind: str) -> tuple:
    """Dense shape of a packed weight's codes: fp4 holds two values per byte."""
    return (*codes_shape[:-1], 2 * codes_shape[-1]) if kind == "fp4" else tuple(codes_shape)


def stored_formats(model_dir: str | Path) -> dict:
    """Canonical weight name -> WeightFormat of every tensor the checkpoint stores quantized with ue8m0
    scales, read from the file headers only: what weight_format="packed" keeps as it is stored.
    fp8 tensors with float scales and stacked fp8 experts are left out (they load dense)."""
    from deepinfer.model_executor.layers.packed_weights import WeightFormat
    model_dir = Path(model_dir)
    names, _ = canonical_names(scan(model_dir))
    tensors, scales = bind_scales(names)
    hint = block_hint(model_dir)
    out = {}
    for name, st in tensors.items():
        sc = scales.get(name)
        if sc is None or sc.dtype not in (torch.float8_e8m0fnu, torch.uint8) or len(st.shape) < 2:
            continue
        if st.dtype == torch.float8_e4m3fn:
            if EXPERT_STACK.search(name):
                continue
            block = infer_block_size(st.shape, sc.shape, hint)
            table = is_engram_table(name)
            if table and block[0] != 1:
                continue
            out[name] = WeightFormat("fp8_table" if table else "fp8", block)
        elif st.dtype in (torch.int8, torch.uint8) and 2 * st.shape[-1] % sc.shape[-1] == 0:
            fmt = WeightFormat("fp4", (1, 2 * st.shape[-1] // sc.shape[-1]))
            m = EXPERT_STACK.search(name)
            if m is None:
                out[name] = fmt
                continue
            base = name[: m.start()]
            leaves = ("w2",) if m.group(1) == "down_proj" else ("w1", "w3")
            for e in range(st.shape[0]):
                for leaf in leaves:
                    out[f"{base}.experts.{e}.{leaf}.weight"] = fmt
    return out
