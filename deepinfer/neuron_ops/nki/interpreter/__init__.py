"""A NumPy interpreter of the NKI subset deepinfer's kernels use, with the module surface of the
`nki` 0.x API: `language` (nl), `isa` (nisa), `jit` and grid launches, enforcing trn2's rules
(rules.py) and counting instructions per engine and DMA bytes (state.Stats, `last_stats()`).

It is what `deepinfer.neuron_ops.nki.api` hands kernels when the real NKI is not importable."""
from deepinfer.neuron_ops.nki.interpreter import isa, language  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter.launch import Kernel, hbm, jit  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter.rules import RULES, NkiRuleError  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter import cost  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter.state import Stats, last_stats  # noqa: F401
from deepinfer.neuron_ops.nki.interpreter.tensor import Tensor  # noqa: F401
