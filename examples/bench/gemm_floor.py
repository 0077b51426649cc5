"""The GEMM floor of an engine step: every matmul of one step, recorded with a dispatch mode (same
shapes, strides and dtypes) and replayed alone on fresh random operands. In inference mode matmul /
einsum / linear reach the dispatch mode undecomposed, so they are recorded too. The step is recorded
through the model's eager forward on the step's own (padded, where the strategy pads) inputs, so a
compiled strategy's floor has the same shapes as its graphs."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.model_executor import step_pack
from deepinfer.model_executor.layers import bf16_rows_gemm, bf16_tiles_gemm  # noqa: F401  (register the ops below)

# the bf16-weight LM head kernels (layers/head_gemm.py) are the head's GEMM where the cpu platform keeps
# a bf16 copy of it, so the floor replays them as it replays the other matmuls
_MM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.einsum.default, torch.ops.aten.linear.default,
           torch.ops.deepinfer.bf16_rows_gemm.default, torch.ops.deepinfer.bf16_tiles_gemm.default}


def _spec(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
        return ("list", [_spec(t) for t in a])
    return ("value", a)


def _build(spec):
    """A random tensor with the recorded shape, strides (transposed weights stay transposed) and dtype."""
    kind = spec[0]
    if kind == "tensor":
        _, shape, stride, dtype = spec
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
        return torch.randn(size, dtype=torch.float32).to(dtype).as_strided(shape, stride)
    if kind == "list":
        return [_build(t) for t in spec[1]]
    return spec[1]


class RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MM_OPS:
            self.calls.append((func, [_spec(a) for a in args]))
        return func(*args, **(kwargs or {}))


def _step_inputs(step):
    """The StepInputs of what a strategy's to_device made: a compiled strategy's PackedStep (one buffer
    and its layout, worker/runners/neuron_regions.py) unpacked on the host, an eager step as it is."""
    from deepinfer.worker.runners.neuron_regions import PackedStep
    if not isinstance(step, PackedStep):
        return step
    inputs = step_pack.unpack(step.buf, step.layout)
    if step.logits_indices is not None:
        inputs = dataclasses.replace(inputs, logits_indices=step.logits_indices)
    return inputs


@contextlib.contextmanager
def recording_step(llm, want):
    """Within the block, the first step of `llm` for which want(step) is true (step: the StepInputs
    its strategy built) runs eagerly under RecordMatmuls; yields a dict whose "calls" it fills."""
    strategy = llm.llm_engine.worker.runner.strategy
    captured = {}
    orig_forward = strategy.forward

    def recording_forward(step, cache, bucket):
        inputs = _step_inputs(step)
        if "calls" not in captured and want(inputs):
            rec = RecordMatmuls()
            with rec:
                out = strategy.model(inputs, cache)
            captured["calls"] = list(rec.calls)
            return out
        return orig_forward(step, cache, bucket)

    strategy.forward = recording_forward
    try:
        yield captured
    finally:
        strategy.forward = orig_forward


class MatmulReplay:
    """The recorded matmuls on fresh random operands, built once; `time()` runs them all once."""

    def __init__(self, calls):
        self.calls = [(func, [_build(a) for a in args]) for func, args in calls]
        self.run()

    def run(self) -> None:
        for func, args in self.calls:
            func(*args)

    def time(self, reps: int = 10) -> float:
        """Seconds for one pass over every matmul (best of 3 rounds of `reps`)."""
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                self.run()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best
