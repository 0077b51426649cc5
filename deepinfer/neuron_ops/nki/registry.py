"""Kernel-table names that have an NKI kernel, mapped to their torch wrappers (nki/ops.py), each with
its reference's argument list (deepinfer/neuron_ops/refs PLAIN; extra launch options are keyword-only
with defaults). `neuron_ops.kernel_routing.kernel` routes exactly these names to NKI; every other
name keeps its PyTorch reference. Add a name here when its kernel and wrapper exist."""
from deepinfer.neuron_ops.nki import attention_ops, ops

IMPLEMENTED = {
    "rms_norm": ops.rms_norm,
    "swiglu": ops.swiglu,
    "blockquant_fp8_gemm": ops.blockquant_fp8_gemm,
    "blockquant_fp8_grouped_gemm": ops.blockquant_fp8_grouped_gemm,
    "blockquant_fp4_gemm": ops.blockquant_fp4_gemm,
    "fp4_static_experts": ops.fp4_static_experts,
    "fp4_active_experts": ops.fp4_active_experts,
    **attention_ops.WRAPPERS,   # sink_attention, index_scores, hc_mixes, hc_pre, hc_post
}
