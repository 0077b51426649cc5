"""NKI kernels of the Neuron path (issue 14) and the CPU interpreter that runs them.

- `api`: the `nki` / `nl` / `nisa` modules kernels import: the real NKI 0.x API where installed,
  else `interpreter` (a NumPy implementation of the subset used, enforcing trn2's rules);
- `kernels/`: the NKI kernels (rms_norm, swiglu, blockquant_fp8_gemm so far);
- `ops`: torch wrappers with the references' argument lists, and `last_stats()`.
Not yet wired into `neuron_ops.kernels` (the kernel table still routes every name to its reference).
"""
