"""The layouts the Neuron NKI kernels read packed weights in, made once at load (docs/neuron.md §3.6).

A packed weight's checkpoint layout (layers/packed_weights.py) is row-major codes with ue8m0 exponent
bytes. The NKI kernels read other layouts (neuron_ops/nki/kernels/blockquant_fp8_gemm.py,
blockquant_fp4_gemm.py); the Neuron platform stores those after loading
(platforms/neuron/weight_layouts.py, called by `NeuronPlatform.kernel_weight_layouts`), so a kernel call hands the stored tensors to the kernel as
they are. The CPU platform keeps the checkpoint layout.

- fp8 linear (`fp8_linear`): codes [128, Kp/128, N] uint8, partition-major (w_p[p, t, n] =
  W[n, 128 t + p], Kp = K rounded up to 128 with zero codes); scales [N/br, Kp] bf16, the value
  2^(e - 127) of each K row of a block (zero-code K rows: 1.0). Bytes: the codes are the checkpoint's
  (plus the K padding, none where K is a multiple of 128); the scales are 2 bytes per block_cols
  weights of a row block instead of 1 per block (1/16 of the code bytes at 32 x 32 blocks).
- fp4 experts (`fp4_experts`): codes [E, K/2, N] and exponents [E, K/g, N], uint8: each expert's
  checkpoint bytes transposed (K-major), 1.00x their bytes.
`layout_bytes` gives what these hold (tools/memory_report.py counts them on the Neuron platform).

Which layout a weight is in is read from its shapes: fp8 kernel-layout codes are 3-D (checkpoint
codes 2-D); fp4 kernel-layout codes and exponents share their last axis (N), checkpoint ones their
second last (N), which never coincide for a group g > 2. The references (layers/quant_gemm.py) read
either: a kernel-layout weight through `fp8_checkpoint_view` / `fp4_checkpoint_view`, the same codes
and exponents the kernel reads (docs/neuron.md §4 A11)."""
from __future__ import annotations

import torch

K_TILE = 128   # the fp8 kernel's contraction tile (partitions)
# e4m3 codes whose exponent field is 15 are finite only in OCP e4m3fn (256..448); trn2's e4m3 reads
# them as inf/NaN (docs/neuron.md §4 A1).
E4M3_EXP_MASK = 0x78


def fp8_is_kernel_layout(codes: torch.Tensor) -> bool:
    """An fp8 weight in the kernel layout ([128, K tiles, N] codes), not checkpoint [N, K] codes."""
    return codes.dim() == 3


def fp4_is_kernel_layout(codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """fp4 pairs / exponents in the kernel layout ([.., K/2, N], [.., K/g, N]), not [.., N, K/2]."""
    return codes.shape[-1] == scale.shape[-1] and codes.shape[-2] != scale.shape[-2]


def _values(exps: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> their values 2^(e - 127) as bf16: the byte is bf16's exponent field."""
    return (exps.to(torch.int16) << 7).view(torch.bfloat16)


def _exponents(values: torch.Tensor) -> torch.Tensor:
    """bf16 powers of two -> their ue8m0 bytes (the inverse of `_values`)."""
    return (values.view(torch.int16) >> 7).to(torch.uint8)


def check_trn2_codes(name: str, codes: torch.Tensor) -> None:
    """Raise if an e4m3 code of `name` is outside trn2's e4m3 (above 240: e4m3fn only)."""
    if codes.is_meta:   # shapes only (tools/memory_report.py): no bytes to check
        return
    bad = (codes & E4M3_EXP_MASK) == E4M3_EXP_MASK
    if bool(bad.any()):
        raise ValueError(f"{name}: {int(bad.sum())} e4m3 codes above 240 (e4m3fn only) do not exist in "
                         "trn2 e4m3; rescale the weight at load (neuron_ops/fp8.py rescale_weight_for_trn2)")


def fp8_linear(codes: torch.Tensor, scale: torch.Tensor, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint (codes uint8 [N, K], exponents uint8 [NB, KB]) -> the fp8 kernel's (w_p, s_bk)."""
    n, k = codes.shape
    kp = -(-k // K_TILE) * K_TILE
    w_kn = torch.zeros(kp, n, dtype=torch.uint8, device=codes.device)
    w_kn[:k] = codes.t()
    w_p = w_kn.reshape(kp // K_TILE, K_TILE, n).permute(1, 0, 2).contiguous()
    s_bk = torch.full((scale.shape[0], kp), 127, dtype=torch.uint8, device=scale.device)
    s_bk[:, :k] = scale.repeat_interleave(block_cols, dim=1)[:, :k]
    return w_p, _values(s_bk).contiguous()


def fp8_checkpoint_view(w_p: torch.Tensor, s_bk: torch.Tensor, k: int,
                        block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel layout's codes [N, K] and exponents [NB, ceil(K / block_cols)] (uint8): what
    `fp8_linear` was given (copies: row-major codes, one exponent byte per block)."""
    kts, n = w_p.shape[1], w_p.shape[2]
    codes = w_p.permute(2, 1, 0).reshape(n, kts * K_TILE)[:, :k].contiguous()
    return codes, _exponents(s_bk[:, 0:k:block_cols])


def fp8_columns(w_p: torch.Tensor) -> int:
    """N of a kernel-layout fp8 weight."""
    return w_p.shape[2]


def fp4_experts(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint (pairs uint8 [.., N, K/2], exponents uint8 [.., N, K/g], g > 2) -> the fp4 kernels'
    ([.., K/2, N], [.., K/g, N]) uint8, contiguous."""
    if codes.shape[-1] == scale.shape[-1]:
        raise ValueError(f"fp4_experts: a group of 2 has no distinct kernel layout ({tuple(codes.shape)})")
    return codes.transpose(-1, -2).contiguous(), scale.transpose(-1, -2).contiguous()


def fp4_checkpoint_view(w_t: torch.Tensor, s_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel layout's pairs [.., N, K/2] and exponents [.., N, K/g]: transposed views."""
    return w_t.transpose(-1, -2), s_t.transpose(-1, -2)


def layout_bytes(kind: str, rows: int, cols: int, block: tuple[int, int]) -> int:
    """Bytes the kernel layout holds for one packed weight of `rows` x `cols` values (kind "fp8": a
    linear with `block` scale blocks; "fp4": one expert projection, block (1, g))."""
    if kind == "fp8":
        kp = -(-cols // K_TILE) * K_TILE
        return kp * rows + 2 * kp * -(-rows // block[0])
    if kind == "fp4":
        return rows * cols // 2 + rows * (cols // block[1])
    raise ValueError(f"layout_bytes: no kernel layout for {kind!r}")
