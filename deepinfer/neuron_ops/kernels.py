"""One entry per kernel the Neuron path uses (design.md §2, neuron.md §3.1).

`kernel(name, on_device)` resolves a name once:
- host mode: the PyTorch reference (neuron_ops/refs/) registered as a custom op, so a compiled region
  holds one node per kernel, as on device;
- device mode: the NKI kernel where one is written (`nki.IMPLEMENTED`, empty today), otherwise the
  plain reference, traced into the region graph and compiled by neuronx-cc.
Every entry has the reference's argument list and output contract. Both MoE names are the fixed-shape
dense form (layers/moe.py `dense_local_experts`) in both modes: no bincount / .tolist() on Neuron.
"""
from deepinfer.model_executor.layers.kernels import KERNEL_NAMES as MODEL_KERNELS
from deepinfer.neuron_ops import nki, refs

# Kernels the model calls through the platform, plus the ones the Neuron path adds (blockquant
# GEMMs for fp8/fp4 weights kept quantized on device, the fused SwiGLU).
KERNEL_NAMES = tuple(MODEL_KERNELS) + ("swiglu", "blockquant_fp8_gemm", "blockquant_fp4_gemm")


# Every routed-expert call on Neuron is the fixed-shape form, padded step or not.
_ALIASES = {"moe_experts_static": "moe_experts"}


def kernel(name: str, on_device: bool = False):
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(KERNEL_NAMES)}")
    name = _ALIASES.get(name, name)
    if name not in refs.PLAIN:
        # A kernel the model added after this table was written: its CPU reference, traced inline.
        from deepinfer.model_executor.layers import kernels as model_kernels
        return model_kernels.reference(name)
    if not on_device:
        return refs.custom_op(name)
    if name in nki.IMPLEMENTED:
        return nki.load(name)
    return refs.PLAIN[name]


def reference(name: str):
    """The plain PyTorch reference of `name` (what kernel tests compare against)."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(KERNEL_NAMES)}")
    name = _ALIASES.get(name, name)
    if name not in refs.PLAIN:
        from deepinfer.model_executor.layers import kernels as model_kernels
        return model_kernels.reference(name)
    return refs.PLAIN[name]
