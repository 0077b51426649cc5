"""The Neuron platform's load-time step that stores a model's packed weights in the NKI kernels'
layouts (model_executor/layers/kernel_layouts.py; docs/neuron.md §3.6), with the fp8 range check."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers import kernel_layouts as kl
from deepinfer.model_executor.layers.packed_weights import PackedFp8Linear


@torch.no_grad()
def lay_out_model(model: nn.Module) -> int:
    """Store every packed fp8 linear and every packed-expert stack of `model` in the kernel layouts,
    after checking each fp8 weight's codes against trn2's e4m3 range (an error names the tensor).
    Idempotent; returns how many modules were laid out. The per-expert modules become views of the
    new stacks (so the checkpoint-layout stacks are freed)."""
    done = 0
    for path, mod in model.named_modules():
        if isinstance(mod, PackedFp8Linear) and not kl.fp8_is_kernel_layout(mod.weight):
            kl.check_trn2_codes(f"{path}.weight", mod.weight)
            mod.weight, mod.scale = kl.fp8_linear(mod.weight, mod.scale, mod.block[1])
            done += 1
        elif (getattr(mod, "_w13_scale", None) is not None
              and not kl.fp4_is_kernel_layout(mod._w13, mod._w13_scale)):
            _lay_out_experts(mod)
            done += 1
    return done


def _lay_out_experts(moe: nn.Module) -> None:
    """A packed MoE's stacks (models/v4_ffn.py `pack`) K-major; its experts' buffers views of them."""
    moe._w13, moe._w13_scale = kl.fp4_experts(moe._w13, moe._w13_scale)
    moe._w2, moe._w2_scale = kl.fp4_experts(moe._w2, moe._w2_scale)
    rows = moe._w13.shape[2] // 2
    for i, e in enumerate(moe.experts.values()):
        e.w1._buffers["weight"], e.w1._buffers["scale"] = moe._w13[i, :, :rows].t(), moe._w13_scale[i, :, :rows].t()
        e.w3._buffers["weight"], e.w3._buffers["scale"] = moe._w13[i, :, rows:].t(), moe._w13_scale[i, :, rows:].t()
        e.w2._buffers["weight"], e.w2._buffers["scale"] = moe._w2[i].t(), moe._w2_scale[i].t()
