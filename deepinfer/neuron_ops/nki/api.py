"""The NKI modules kernels are written against: the real `nki` 0.x API (shipped in neuronx-cc as
`neuronxcc.nki`) when it is importable, else the NumPy interpreter with the same surface.
Kernels import `nki, nl, nisa` from here and so run unchanged on either."""
try:  # pragma: no cover - only on a Neuron install
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl
    INTERPRETED = False
except ImportError:
    from deepinfer.neuron_ops.nki import interpreter as nki
    from deepinfer.neuron_ops.nki.interpreter import isa as nisa  # noqa: F401
    from deepinfer.neuron_ops.nki.interpreter import language as nl  # noqa: F401
    INTERPRETED = True
