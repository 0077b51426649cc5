"""One entry per kernel the Neuron path uses, and the NKI kernels planned for some of them.

`kernel(name, on_device)` resolves a name once:
- host mode: the PyTorch reference (neuron_ops/refs/) registered as a custom op, so a compiled region
  holds one node per kernel, as a device graph would hold one NKI call;
- device mode: the plain reference, traced into the region graph and compiled op by op by neuronx-cc.
No NKI kernel is written yet; `PLANNED_NKI_KERNELS` says which names will get one.
Every entry has the reference's argument list and output contract. Both MoE names (and both packed
fp4 MoE names) are the fixed-shape forms in both modes: no bincount / .tolist() on Neuron.
"""
from deepinfer.model_executor.layers.kernels import KERNEL_NAMES as MODEL_KERNELS
from deepinfer.neuron_ops import refs

# Kernels the model calls through the platform, plus the fused SwiGLU the Neuron path adds.
KERNEL_NAMES = tuple(MODEL_KERNELS) + ("swiglu",)

# kernel name -> the NKI kernel it is to get (issue 14, "NKI kernels for the Neuron path"). Until one
# is written its name runs as the reference.
PLANNED_NKI_KERNELS = {
    "blockquant_fp8_gemm": "fp8 e4m3 32x32-block GEMM: dequantize in SBUF on the vector engine, fp32 PSUM, grid 2",
    "blockquant_fp4_gemm": "fp4 e2m1 1x32-group GEMM (and its grouped expert form), same tiling as fp8",
    "sink_attention": "sparse attention over gathered KV records: sink logit, fp32 online softmax, "
                      "P rounded to bf16 per 64 keys before P.V",
    "index_scores": "indexer scores sum_h w_h * ReLU(q_h . k): ReLU at PSUM evacuation, head sum as a matmul",
    "hc_mixes": "mHC mixes: fp32 projection + Sinkhorn iterations",
    "hc_pre": "mHC collapse of the residual streams",
    "hc_post": "mHC expand back into the residual streams",
    "rms_norm": "RMSNorm",
    "swiglu": "SwiGLU with the clamp limit",
}
assert set(PLANNED_NKI_KERNELS) <= set(KERNEL_NAMES)


# Every routed-expert call on Neuron is the fixed-shape form, padded step or not.
_ALIASES = {"moe_experts_static": "moe_experts", "fp4_routed_experts": "fp4_static_experts"}


def _resolve(name: str) -> str:
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(KERNEL_NAMES)}")
    return _ALIASES.get(name, name)


def kernel(name: str, on_device: bool = False):
    """The callable the Neuron platform hands the model for `name`."""
    name = _resolve(name)
    return refs.PLAIN[name] if on_device else refs.custom_op(name)


def reference(name: str):
    """The plain PyTorch reference of `name` (what kernel tests compare against)."""
    return refs.PLAIN[_resolve(name)]
