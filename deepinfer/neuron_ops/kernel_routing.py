"""Where the Neuron platform routes each kernel-table name: an NKI kernel, the kernel run in the
NKI interpreter, or the PyTorch reference.

`kernel(name, on_device, simulate)` resolves a name once:
- host mode: the PyTorch reference (neuron_ops/refs/) registered as a custom op, so a compiled region
  holds one node per kernel, as a device graph would hold one NKI call; with `simulate`
  (DEEPINFER_NEURON_KERNELS=simulate) a name that has an NKI kernel (nki/registry.py IMPLEMENTED)
  is instead a custom op `nki_<name>` with the same fake whose implementation runs the kernel in the
  NKI interpreter (nki/ops.py);
- device mode: a name with an NKI kernel goes to it through torch-neuronx (nki/device.py) when the
  real nki and /dev/neuron are present; every other name is the plain reference,
  traced into the region graph and compiled op by op by neuronx-cc.
`NKI_KERNELS` describes the kernels; IMPLEMENTED says which exist.
Every entry has the reference's argument list and output contract. Both MoE names (and both packed
fp4 MoE names) are the fixed-shape forms in both modes: no bincount / .tolist() on Neuron.
"""
import functools

from deepinfer.model_executor.layers.kernel_table import KERNEL_NAMES as MODEL_KERNELS
from deepinfer.neuron_ops import refs

# Kernels the model calls through the platform, plus the fused SwiGLU the Neuron path adds.
KERNEL_NAMES = tuple(MODEL_KERNELS) + ("swiglu",)

# kernel name -> what its NKI kernel does. Each has one (nki/registry.py IMPLEMENTED adds the
# packed-expert and grouped fp8 forms): host mode runs them in the NumPy interpreter with
# DEEPINFER_NEURON_KERNELS=simulate, a device through nki/device.py; the rest of the table's names
# run as their references.
NKI_KERNELS = {
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
assert set(NKI_KERNELS) <= set(KERNEL_NAMES)


# Every routed-expert call on Neuron is the fixed-shape form, padded step or not.
_ALIASES = {"moe_experts_static": "moe_experts", "fp4_routed_experts": "fp4_static_experts"}


def _resolve(name: str) -> str:
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(KERNEL_NAMES)}")
    return _ALIASES.get(name, name)


def implemented() -> dict:
    """Kernel-table name -> NKI wrapper, for the names that have an NKI kernel (imported on demand)."""
    from deepinfer.neuron_ops.nki.registry import IMPLEMENTED
    return IMPLEMENTED


def kernel(name: str, on_device: bool = False, simulate: bool = False):
    """The callable the Neuron platform hands the model for `name`."""
    name = _resolve(name)
    if on_device:
        from deepinfer.neuron_ops.nki import device
        if name in implemented() and device.available():  # pragma: no cover - device only
            return device.device_kernel(name)
        return refs.PLAIN[name]
    if simulate and name in implemented():
        return _simulated_op(name)
    return refs.custom_op(name)


_SIMULATED: dict = {}


def _simulated_op(name: str):
    """`name`'s NKI wrapper as custom op deepinfer_neuron::nki_<name>, with the reference's schema
    (inferred from its signature, which functools.wraps hands on) and fake: one graph node whose
    implementation runs the kernel in the interpreter."""
    if name not in _SIMULATED:
        impl = implemented()[name]
        fn = functools.wraps(refs.PLAIN[name])(lambda *args, **kwargs: impl(*args, **kwargs))
        _SIMULATED[name] = refs._op(f"nki_{name}", fn, refs.FAKES[name])
    return _SIMULATED[name]


def reference(name: str):
    """The plain PyTorch reference of `name` (what kernel tests compare against)."""
    return refs.PLAIN[_resolve(name)]
