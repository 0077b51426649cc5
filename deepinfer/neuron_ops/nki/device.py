"""Device routing of the NKI kernels: on a NeuronCore, a kernel-table name with an NKI kernel runs
through torch-neuronx's NKI call (an `nki.jit` kernel launched on torch XLA tensors with its grid,
`kernel[grid](*tensors)`, which torch-neuronx lowers to one custom call in the region graph).

Imported lazily, only by `neuron_ops.kernel_routing.kernel(name, on_device=True)` when `available()`
(what has run on which machine: docs/status.md). The packed weights reach a device already in the
layouts the kernels read, made once at load (model_executor/layers/kernel_layouts.py, with the fp8
codes' trn2 range check), so a wrapper issues no weight relayout or host read of a weight per call;
a checkpoint-layout weight is refused here (nki/ops.py `_on_device_needs_layout`)."""
from __future__ import annotations

import functools
import glob


def available() -> bool:
    """The real NKI is importable and a Neuron device exists."""
    if not glob.glob("/dev/neuron*"):
        return False
    try:  # pragma: no cover - only on a Neuron install
        import neuronxcc.nki  # noqa: F401
        import torch_neuronx  # noqa: F401
    except ImportError:
        return False
    return True  # pragma: no cover


def device_kernel(name: str):  # pragma: no cover - device only
    """The wrapper of `name` with its launches sent to the NeuronCore."""
    import torch_neuronx  # noqa: F401  (registers the XLA device and the NKI custom call)

    from deepinfer.neuron_ops.nki import ops
    from deepinfer.neuron_ops.nki.registry import IMPLEMENTED
    impl = IMPLEMENTED[name]

    @functools.wraps(impl)
    def call(*args, **kwargs):
        with ops.on_device():
            return impl(*args, **kwargs)
    return call
