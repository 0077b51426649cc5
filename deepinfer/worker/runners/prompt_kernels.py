"""Fused elementwise kernels for the eager prompt steps of the compiled CPU runner (cpu_compiled.py).

Prompt steps fit no static bucket, so they run eagerly; in them the hyper-connection mixes (RMS, the
sigmoid gates, 20 Sinkhorn iterations), the pre / post applications, RMSNorm and RoPE are chains of
small memory-bound ops over [T, n, D] tensors: a 32 x 64-token prompt step spent about a third of
its time in the hyper-connection ops alone (torch.profiler, tiny V4, one thread; README "Compiled CPU
decode step"). Each of these kernels is a pure function of its tensors, so it is compiled once, only
its token dimension dynamic (one graph serves every prompt length: no bucket, no padding), by the
platform's compile backend. The names and argument lists are the kernel table's (layers/kernel_table.py); only the
implementation differs, and the results equal the references to rounding (the fused reductions may
add in another order). Decode steps never use this table: their regions trace the reference
kernels (a compiled function inside a traced region would be inlined anyway).
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch

from deepinfer.model_executor.layers import attention, compressor, hc, norm, rope


def _hc_mixes(x, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    # Sinkhorn's out-of-place form: inductor fuses its 40 normalisations per token into one loop,
    # where the in-place form on a transposed copy (hc.sinkhorn, fastest eagerly) compiles to slower code
    pre, post, logits = hc.hc_gates(x, fn, base, scale, norm_eps, hc_eps)
    return pre, post, hc.sinkhorn_out_of_place(logits, iters, hc_eps)


# kernel name -> the formulation that compiles best (the same math as the kernel table's reference)
FUSED_PROMPT_KERNELS = {
    "hc_mixes": _hc_mixes,
    "hc_pre": hc.hc_pre_apply,
    "hc_post": hc.hc_post_broadcast,
    "hc_head": hc.hc_head_weights,
    "rms_norm": norm.rms_norm,
    "rope": rope.apply_rope,
    "compress_pool": compressor.pool_entries,
}


def token_dynamic(fn, backend: str):
    """fn compiled with only the token dimension dynamic: dim 0 of every tensor argument that is not a
    parameter. `dynamic=True` would make every dim symbolic (n = 4 streams, D, the head dims too),
    and inductor then emits generic loops: Sinkhorn at T = 2048 took 5.1 ms that way, 1.4 ms with
    only T dynamic (one thread)."""
    compiled = torch.compile(fn, backend=backend)

    def call(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args, **kwargs)
    call.__name__ = f"token_dynamic_{getattr(fn, '__name__', 'kernel')}"
    return call


def fused_kernel_table(kernels, backend: str):
    """A copy of `kernels` (a KernelTable) whose FUSED_PROMPT_KERNELS are compiled, token dim dynamic."""
    table = copy.copy(kernels)
    for name, fn in FUSED_PROMPT_KERNELS.items():
        setattr(table, name, token_dynamic(fn, backend))
    # the attention keeps its loop over query chunks (a bounded score tensor) around a compiled chunk
    table.sink_attention = functools.partial(attention.sink_attention,
                                             rows_fn=token_dynamic(attention.sink_attention_rows, backend))
    return table


@contextlib.contextmanager
def kernels_of(model, table):
    """Run the model's forward with `table` as its kernel table (StepContext reads `model.kernels`)."""
    saved = model.kernels
    model.kernels = table
    try:
        yield
    finally:
        model.kernels = saved
