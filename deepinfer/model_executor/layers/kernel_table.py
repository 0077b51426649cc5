"""Named kernels the model calls through the platform (`platform.kernel(name)`, docs/architecture.md §2).

Each name maps to a pure-PyTorch reference here; the Neuron platform maps the same names to NKI
kernels on device and to references with the same argument lists in host mode."""
from deepinfer.model_executor.layers import attention, compressor, engram, hc, indexer, moe, norm, quant_gemm, rope

_REFERENCES = {
    "rms_norm": norm.rms_norm,
    "rope": rope.apply_rope,
    "hc_mixes": hc.hc_mixes,
    "hc_pre": hc.hc_pre_apply,
    "hc_post": hc.hc_post_apply,
    "hc_head": hc.hc_head_weights,
    "sink_attention": attention.sink_attention,
    "index_scores": indexer.index_scores,
    "compress_pool": compressor.pool_entries,
    "moe_experts": moe.routed_experts,
    "moe_experts_static": moe.static_routed_experts,   # padded steps (StepInputs.static_shapes)
    "moe_experts_active": moe.active_local_experts,    # padded steps reading only the hit experts
    "expert_mlp": moe.expert_mlp,
    "engram_gate": engram.engram_gate,
    # weights kept in their checkpoint formats (layers/packed_weights.py)
    "blockquant_fp8_gemm": quant_gemm.blockquant_fp8_gemm,
    "blockquant_fp8_grouped_gemm": quant_gemm.blockquant_fp8_grouped_gemm,
    "blockquant_fp4_gemm": quant_gemm.blockquant_fp4_gemm,
    "fp4_routed_experts": quant_gemm.fp4_routed_experts,
    "fp4_static_experts": quant_gemm.fp4_static_experts,     # padded steps (StepInputs.static_shapes)
    "fp4_active_experts": quant_gemm.fp4_active_experts,     # padded steps reading only the hit experts
    "fp8_table_rows": quant_gemm.fp8_table_rows,
}

KERNEL_NAMES = tuple(_REFERENCES)


def reference(name: str):
    if name not in _REFERENCES:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(KERNEL_NAMES)}")
    return _REFERENCES[name]


class KernelTable:
    """Attribute access to a platform's kernels, resolved once at model construction."""

    def __init__(self, platform=None):
        for name in KERNEL_NAMES:
            setattr(self, name, platform.kernel(name) if platform is not None else reference(name))
