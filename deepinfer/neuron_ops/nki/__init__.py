"""NKI device kernels (neuron.md §3.6): stubs only.

No NKI code has been written or run in this tree (no Trainium hardware, and the real `nki` /
`neuronx-cc` wheels are not installable here). Each kernel name maps to the module that will hold
it; `load(name)` imports nothing device-specific until called, then raises a clear error: without a
Neuron device and toolchain `NeuronDeviceRequired`, with them `NotImplementedError` (not written).
`neuron_ops/kernels.py` therefore routes every name to its PyTorch reference in both modes and
only asks here for names in `IMPLEMENTED` (empty).
"""
import glob
import importlib

# kernel name -> stub module under deepinfer/neuron_ops/nki/
MODULES = {
    "blockquant_fp8_gemm": "blockquant",
    "blockquant_fp4_gemm": "blockquant",
    "sink_attention": "sparse_attn",
    "index_scores": "index_score",
    "compress_pool": "index_score",
    "hc_mixes": "hc",
    "hc_pre": "hc",
    "hc_post": "hc",
    "rms_norm": "norm",
    "swiglu": "norm",
}

IMPLEMENTED: frozenset[str] = frozenset()


class NeuronDeviceRequired(RuntimeError):
    """An NKI kernel was requested where no Neuron device / NKI toolchain is present."""


def require_toolchain(name: str) -> None:
    """Raise NeuronDeviceRequired unless a Neuron device exists and `nki` imports."""
    if not glob.glob("/dev/neuron*"):
        raise NeuronDeviceRequired(f"NKI kernel {name!r} needs a Neuron device (/dev/neuron* not found); "
                                   "host mode uses the PyTorch reference in deepinfer/neuron_ops/refs/")
    try:
        importlib.import_module("nki")
    except ImportError as e:
        raise NeuronDeviceRequired(f"NKI kernel {name!r} needs the `nki` package from the Neuron pip "
                                   f"repository (requirements-neuron.txt): {e}") from None


def load(name: str):
    """The NKI kernel of `name` (device only)."""
    if name not in MODULES:
        raise ValueError(f"nki kernel: unknown name {name!r}; known: {', '.join(sorted(MODULES))}")
    module = importlib.import_module(f"deepinfer.neuron_ops.nki.{MODULES[name]}")
    return module.load(name)
