"""NKI stub: fp8 32x32 / fp4 1x32 blockquant GEMMs (dequantize in SBUF on the VectorE, K-major
weights, grid 2) (neuron.md §3.6).

Not written. `load` raises; the platform uses the PyTorch reference for these names."""
from deepinfer.neuron_ops.nki import require_toolchain


def load(name: str):
    require_toolchain(name)
    raise NotImplementedError(f"NKI kernel {name!r} is not written in this tree; "
                              "the Neuron platform runs its PyTorch reference (neuron_ops/refs/)")
