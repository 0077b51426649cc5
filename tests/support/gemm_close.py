"""Closeness of a kernel's GEMM output to its reference's: equal up to fp32 summation order and, for
bf16 outputs, one final rounding (tests/neuron)."""
import torch

from deepinfer.model_executor.layers.quant_gemm import dequant_fp8_rows


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bf16 spacing (fp32 summation order may flip the last bit)."""
    w = want.float()
    spacing = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(1e-30))[1] - 8)
    return (got.float() - w).abs() / spacing


def gemm_close(got, want, x, codes, scale) -> bool:
    """Equal up to fp32 summation order (bounded by the sum of |products|) and, for bf16 outputs,
    one final rounding."""
    n, k = codes.shape
    bound = x.float().abs() @ dequant_fp8_rows(codes, scale, 32, 32, 0, n).abs().t()
    err = (got.float() - want.float()).abs() - 1e-6 * k ** 0.5 * bound
    if got.dtype == torch.bfloat16:
        return bool((bf16_ulps(want.float() + err.clamp_min(0), want) <= 1).all())
    return bool((err <= 0).all())
