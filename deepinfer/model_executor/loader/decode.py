"""Reading a planned item: only its rank's region of the stored codes and scale (model_executor/
shard_plan.py), decoded to dense values or kept as packed bytes."""
from __future__ import annotations

import torch

from deepinfer.model_executor.layers.quant import dequant_fp4, dequant_fp8_block, float_to_ue8m0, infer_block_size
from deepinfer.model_executor.loader.plan import Item
from deepinfer.model_executor.loader.scan import Stored
from deepinfer.model_executor.shard_plan import code_regions, read_slice


def regions(item: Item, hint, packed: bool) -> tuple[dict, dict, dict]:
    """What of the item's codes and scale this rank reads, and what to cut after decoding
    (model_executor/shard_plan.py); empty for a whole tensor."""
    if item.experts is not None:
        rows = {0: (item.experts.start, item.experts.stop)}
        return rows, rows, {}
    if not item.cuts:
        return {}, {}, {}
    if item.fmt != "fp8":
        return {c.dim: (c.start, c.stop) for c in item.cuts}, {}, {}
    block = infer_block_size(item.src.shape, item.scale.shape, hint)
    return code_regions(item.src.key, item.cuts, block, packed)


def read(f, st: Stored, region: dict) -> torch.Tensor:
    return read_slice(f, st.key, len(st.shape), region)


def raw_codes(item: Item, f_src, f_scale, hint=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed item's stored codes and ue8m0 exponents, both as uint8 bytes."""
    code_region, scale_region, _ = regions(item, hint, packed=True)
    codes = read(f_src, item.src, code_region).view(torch.uint8)
    s = read(f_scale, item.scale, scale_region)
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return codes, s.view(torch.uint8)
    try:   # float scales: exact powers of two become ue8m0 bytes, anything else cannot stay packed
        return codes, float_to_ue8m0(s).view(torch.uint8)
    except ValueError:
        raise ValueError(f"tensor {item.src.key!r}: its scale {item.scale.key!r} is not a power of two, which "
                         f"packed weights need (ue8m0); use weight_format='dense'") from None


def decode(item: Item, f_src, f_scale, hint) -> torch.Tensor:
    code_region, scale_region, trim = regions(item, hint, packed=False)
    t = read(f_src, item.src, code_region)
    if item.fmt == "fp8":
        s = read(f_scale, item.scale, scale_region)
        block = infer_block_size(item.src.shape, item.scale.shape, hint)   # the stored tensor's grid
        t = dequant_fp8_block(t, s, block)
        for dim, (start, size) in trim.items():   # dense slices read whole blocks (shard_plan.covering)
            t = t.narrow(dim, start, size)
        return t
    if item.fmt == "fp4":
        return dequant_fp4(t, read(f_scale, item.scale, scale_region))
    return t
