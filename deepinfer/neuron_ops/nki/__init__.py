"""NKI kernels of the Neuron path and the CPU interpreter that runs them (docs/neuron.md §3.6).

- `api`: the `nki` / `nl` / `nisa` modules kernels import: the real NKI 0.x API where installed,
  else `interpreter` (a NumPy implementation of the subset used, enforcing trn2's rules);
- `kernels/`: the NKI kernels;
- `ops` (GEMMs, experts, rms_norm, swiglu) and `attention_ops` (sink attention, indexer scores, mHC):
  torch wrappers with the references' argument lists; `ops.last_stats()`;
- `registry.IMPLEMENTED`: kernel-table name -> wrapper, what `neuron_ops.kernel_routing.kernel`
  routes to NKI (host mode with DEEPINFER_NEURON_KERNELS=simulate: the interpreter; device: `device.py`);
- `simulation_counts()`: {kernel name: calls} since the process started.
"""
from deepinfer.neuron_ops.nki.counts import simulation_counts  # noqa: F401
