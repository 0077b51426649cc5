"""References of the blockquant GEMM kernels (docs/neuron.md §3.6): y = x @ dequant(W)^T.

Arguments are what the device kernel reads (docs/neuron.md §4 A11): weight codes as uint8 bytes, ue8m0
scales as uint8 exponent bytes, the block shape as ints; no dtype bitcasts inside a graph."""
import torch

from deepinfer.model_executor.layers import quant


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    return quant.ue8m0_to_float(scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale)


def blockquant_fp8_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                        block_cols: int) -> torch.Tensor:
    """x: [M, K]; w_codes: uint8 e4m3 bytes [N, K]; w_scale: uint8 ue8m0 [ceil(N/br), ceil(K/bc)].
    fp32 accumulation, output in x's dtype. On trn2 the bytes are read as IEEE e4m3, which equals
    e4m3fn for every byte of a rescaled weight (|v| <= 224, see neuron_ops/fp8.py)."""
    if w_codes.dtype != torch.uint8:
        raise ValueError(f"w_codes dtype: expected uint8 e4m3 bytes, got {w_codes.dtype}")
    values = w_codes.view(torch.float8_e4m3fn)
    w = quant.dequant_fp8_block(values, _ue8m0(w_scale), (block_rows, block_cols), out_dtype=torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


def blockquant_fp4_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, group: int) -> torch.Tensor:
    """x: [M, K]; w_packed: uint8 e2m1 pairs [N, K/2] (low nibble first); w_scale: uint8 ue8m0 [N, K/group].
    trn2 has no FP4 datapath (docs/neuron.md §4 A7): the device kernel dequantizes in SBUF; so does this."""
    if w_packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"w_packed dtype: expected uint8/int8 e2m1 pairs, got {w_packed.dtype}")
    w = quant.dequant_fp4(w_packed, _ue8m0(w_scale), group, out_dtype=torch.float32)
    return (x.float() @ w.t()).to(x.dtype)
