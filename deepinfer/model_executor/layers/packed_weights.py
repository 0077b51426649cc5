"""Weights kept in their checkpoint formats (weight_format="packed"; docs/model.md §2.1).

A packed tensor is its codes plus its ue8m0 scale, both uint8 buffers under the checkpoint's own
names (`X.weight`, `X.scale`), so the loader copies the stored bytes and never builds a dense copy:
- `PackedFp8Linear`: e4m3 codes [N, K] + one exponent byte per (block_rows x block_cols) block;
- `PackedFp4Weight`: e2m1 pairs [N, K/2] (low nibble first) + one exponent byte per `group` values
  (routed experts; their MoE stacks them, see models/v4_ffn.py);
- `PackedFp8Table`: e4m3 rows [R, d] + one exponent byte per `group` values of a row (Engram).
`WeightFormat` says which canonical tensors are packed and how; the loader derives it from the
checkpoint files (`loader.stored_formats`), the memory report from the config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightFormat:
    kind: str                 # "fp8" (block linear) | "fp4" (expert, per-group) | "fp8_table" (per-row groups)
    block: tuple[int, int]    # fp8: (rows, cols) of a scale block; fp4 / fp8_table: (1, group)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.block[0]), -(-cols // self.block[1])


def _codes(rows: int, cols: int, device=None) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.uint8, device=device)


def _exponents(shape, device=None) -> torch.Tensor:
    return torch.full(shape, 127, dtype=torch.uint8, device=device)   # 2^0 until loaded


class PackedFp8Linear(nn.Module):
    """y = x @ W^T with W kept as e4m3 codes and ue8m0 block exponents."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, device=None):
        super().__init__()
        if fmt.kind != "fp8":
            raise ValueError(f"PackedFp8Linear: expected an fp8 format, got {fmt}")
        self.in_features, self.out_features, self.block = in_features, out_features, fmt.block
        self.register_buffer("weight", _codes(out_features, in_features, device))
        self.register_buffer("scale", _exponents(fmt.scale_shape(out_features, in_features), device))


class PackedFp4Weight(nn.Module):
    """One expert projection as e2m1 pairs and ue8m0 group exponents (loaded, then stacked by the MoE)."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, device=None):
        super().__init__()
        if fmt.kind != "fp4" or in_features % 2 or in_features % fmt.block[1]:
            raise ValueError(f"PackedFp4Weight: {in_features} inputs do not fit {fmt}")
        self.in_features, self.out_features, self.group = in_features, out_features, fmt.block[1]
        self.register_buffer("weight", _codes(out_features, in_features // 2, device))
        self.register_buffer("scale", _exponents((out_features, in_features // self.group), device))


class PackedFp8Table(nn.Module):
    """A lookup table of e4m3 rows with ue8m0 exponents per `group` values of a row."""

    def __init__(self, rows: int, dim: int, fmt: WeightFormat, device=None):
        super().__init__()
        if fmt.kind != "fp8_table" or fmt.block[0] != 1 or dim % fmt.block[1]:
            raise ValueError(f"PackedFp8Table: rows of {dim} values do not fit {fmt}")
        self.group = fmt.block[1]
        self.register_buffer("weight", _codes(rows, dim, device))
        self.register_buffer("scale", _exponents((rows, dim // self.group), device))


def linear_mm(x: torch.Tensor, lin: nn.Module, k) -> torch.Tensor:
    """x @ W^T for a dense nn.Linear or a PackedFp8Linear (through the platform's fp8 GEMM kernel)."""
    if isinstance(lin, PackedFp8Linear):
        return k.blockquant_fp8_gemm(x, lin.weight, lin.scale, lin.block[0], lin.block[1])
    return x @ lin.weight.t()


def grouped_mm(x: torch.Tensor, lin: nn.Module, k) -> torch.Tensor:
    """x: [T, G, K] against a weight of G equal row groups -> [T, G, R] (dense or packed fp8)."""
    if isinstance(lin, PackedFp8Linear):
        return k.blockquant_fp8_grouped_gemm(x, lin.weight, lin.scale, lin.block[0], lin.block[1])
    w = lin.weight.view(x.shape[1], -1, x.shape[2])
    return torch.einsum("tgk,grk->tgr", x, w)


def is_packed(module: nn.Module) -> bool:
    return isinstance(module, (PackedFp8Linear, PackedFp4Weight, PackedFp8Table))
