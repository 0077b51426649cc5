"""Torch entry points of the NKI kernels, with their references' argument lists
(deepinfer/neuron_ops/refs PLAIN): each converts its torch inputs to the layout the kernel reads,
runs the kernel in the interpreter (or the real NKI simulator where `nki` is installed) and returns
a torch tensor in the reference's output dtype. `last_stats()` gives the interpreter's counts of the
latest call."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deepinfer.neuron_ops.nki import api
from deepinfer.neuron_ops.nki.kernels.blockquant_fp8_gemm import K_TILE, N_TILE, blockquant_fp8_gemm_kernel
from deepinfer.neuron_ops.nki.kernels.rms_norm import rms_norm_kernel
from deepinfer.neuron_ops.nki.kernels.swiglu import swiglu_kernel

_TORCH_TO_NL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.uint8: "uint8", torch.int32: "int32"}
_NL_TO_TORCH = {v: k for k, v in _TORCH_TO_NL.items()}


def _hbm(t: torch.Tensor):
    """An HBM input of the kernel: the tensor's values with its dtype."""
    name = _TORCH_TO_NL.get(t.dtype)
    if name is None:
        raise TypeError(f"nki kernels: unsupported input dtype {t.dtype}")
    dt = getattr(api.nl, name)
    values = t.detach().cpu()
    values = (values.float() if dt.is_float else values).contiguous().numpy()
    return api.nki.hbm(values, dt) if api.INTERPRETED else values  # pragma: no branch


def _torch(out) -> torch.Tensor:
    if not api.INTERPRETED:  # pragma: no cover - real simulator returns NumPy in the output dtype
        return torch.from_numpy(np.asarray(out))
    return torch.from_numpy(out.numpy()).to(_NL_TO_TORCH[out.dtype.name])


def _run(kernel, grid, *args):
    if api.INTERPRETED:
        return kernel[grid](*args)
    return api.nki.simulate_kernel(kernel[grid], *args)  # pragma: no cover


def last_stats():
    """The interpreter's counts (instructions per engine, DMA bytes, peaks) of the latest kernel call."""
    return api.nki.last_stats() if api.INTERPRETED else None


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w = (torch.ones(shape[-1], dtype=torch.float32) if weight is None else weight).reshape(1, -1)
    out = _run(rms_norm_kernel, 1, _hbm(x2), _hbm(w), float(eps))
    return _torch(out).reshape(shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    shape = gate.shape
    out = _run(swiglu_kernel, 1, _hbm(gate.reshape(-1, shape[-1])), _hbm(up.reshape(-1, shape[-1])), float(limit))
    return _torch(out).reshape(shape)


# e4m3 codes whose exponent field is 15 are finite only in OCP e4m3fn (256..448); trn2's e4m3 reads
# them as inf/NaN, so weights must be brought under 240 at load (docs/neuron.md section 4, A1).
_E4M3_EXP_MASK = 0x78


def blockquant_fp8_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                        block_cols: int, grid: int = 2) -> torch.Tensor:
    """y = x @ W^T with the reference's arguments (quant_gemm.blockquant_fp8_gemm); x: [M, K] with
    M <= 128 (decode); the weight is re-laid K-major here, as the packed-weights load will store it."""
    if w_codes.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise ValueError("blockquant_fp8_gemm: w_codes and w_scale must be uint8 bytes")
    if N_TILE % block_rows or K_TILE % block_cols:
        raise ValueError(f"blockquant_fp8_gemm kernel: block {block_rows}x{block_cols} must divide "
                         f"{N_TILE}x{K_TILE}")
    if bool(((w_codes & _E4M3_EXP_MASK) == _E4M3_EXP_MASK).any()):
        raise ValueError("blockquant_fp8_gemm kernel: codes above 240 (e4m3fn only) do not exist in trn2 e4m3")
    m, k = x.shape
    n = w_codes.shape[0]
    kp = -(-k // K_TILE) * K_TILE
    x_p = torch.zeros(m, kp, dtype=x.dtype)
    x_p[:, :k] = x
    w_kn = torch.zeros(kp, n, dtype=torch.uint8)
    w_kn[:k] = w_codes.t()
    s_kn = torch.full((kp, w_scale.shape[0]), 127, dtype=torch.uint8)
    s_kn[:k] = w_scale.t().repeat_interleave(block_cols, dim=0)[:k]
    out = _run(blockquant_fp8_gemm_kernel, api.nl.nc(grid) if grid > 1 else 1, _hbm(x_p), _hbm(w_kn),
               _hbm(s_kn), int(block_rows))
    return _torch(out)
