"""CudaGraphStrategy: decode steps replayed from CUDA graphs, one per (row bucket, context bucket).

As in DeepSeek's engine (docs/architecture.md §3.2), only decode steps replay a graph; steps with a
prompt chunk run eagerly. Per decode step: pick the bucket (model_executor/static_step.py BucketSpec with
the CUDA row buckets), pad the chunks with placeholder rows (scratch slot 0 / block 0), build the
metadata on the host, give every data-dependent length a static size (`pad_step`, logits rows
included), copy it into the bucket's persistent device buffers and replay. The model sees
`StepInputs.static_shapes`, so its routed MoE takes the fixed-shape kernel ("moe_experts_static":
no bincount, no `.tolist()`); every other op of the forward is sync-free already, and per-device
tables (RoPE, Engram hashing) are made on first use, during the warm-up before a capture
(tests/engine/test_cuda_graph_runner.py checks both on meta tensors).

A bucket's graph is captured the first time a step needs it, or at start-up by `warm_up`
(EngineConfig.warmup_graphs), from a step of placeholder rows only: the warm-up forwards and the
capture read and write nothing but the scratch slot and block. All graphs share
one memory pool; they are replayed one at a time, and each replay's logits are consumed before the
next. The logits a replay returns live in an output buffer shared by every graph with the same
row count (one [rows, vocab] buffer per row bucket, not per (rows, context) graph): valid until
the next step.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from deepinfer.model_executor.forward_meta import SeqChunk, StepInputs, build_step_inputs, step_to
from deepinfer.model_executor.static_step import Bucket, BucketSpec, static_signature
from deepinfer.worker.runners.base import RunnerStrategy, host_inputs

logger = logging.getLogger(__name__)

# Eager forwards on a side stream before a capture: the first one initializes lazily created state
# (cuBLAS handles and workspaces, cached per-device tables) outside the capture.
WARMUP_RUNS = 2


class CudaGraphCapture:
    """Captures a callable into a torch.cuda.CUDAGraph; every graph of a runner shares one pool."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = None

    def __call__(self, fn):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class HostReplay:
    """Stand-in for CudaGraphCapture where no GPU is present (tests): "replay" runs the captured
    callable again. It keeps everything else of the runner real (buckets, placeholder capture,
    persistent input buffers refilled each step, fixed-shape kernels, the output buffer), so a field
    the runner forgot to refill shows up as wrong tokens on CPU. It does not prove capturability;
    the meta-tensor test and the GPU tests do."""

    def __call__(self, fn):
        out = fn()
        holder = {"out": out}

        def replay():
            holder["out"].copy_(fn())
        return replay, out


@dataclasses.dataclass
class _Graph:
    inputs: StepInputs      # persistent device buffers the graph reads
    output: torch.Tensor    # logits buffer the graph writes, shared per row count: [bucket tokens, vocab]
    replay: object
    signature: tuple
    cache: object           # the cache the graph was captured against (it writes into it)


def _copy_into(dst, src) -> None:
    """Refill a graph's input buffers from a host-built step of the same signature."""
    for f in dataclasses.fields(dst):
        d, s = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(d, torch.Tensor):
            d.copy_(s, non_blocking=True)
        elif isinstance(d, dict):
            for key in d:
                _copy_into(d[key], s[key])


class CudaGraphStrategy(RunnerStrategy):
    name = "cuda_graphs"

    def __init__(self, model, layout, platform=None, buckets: BucketSpec | None = None, capture=None):
        super().__init__(model, layout, platform, buckets)
        if buckets is None:
            raise ValueError("CudaGraphStrategy: needs a BucketSpec (CudaPlatform.bucket_spec)")
        if buckets.prefill_tokens is not None:
            raise ValueError("CudaGraphStrategy: graphs are for decode steps; prefill_tokens must be None")
        self.capture = capture if capture is not None else CudaGraphCapture(self.device)
        self.graphs: dict[Bucket, _Graph] = {}
        self._outputs: dict[int, torch.Tensor] = {}   # rows -> logits buffer all graphs of that size fill
        self.eager_steps = 0
        self.replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def select_bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        return self.buckets.select(chunks)

    def _static(self, chunks: list[SeqChunk], bucket: Bucket) -> StepInputs:
        return self.buckets.static_step(chunks, bucket, self.layout, logits_rows=bucket.num_tokens)

    def prepare_host(self, chunks: list[SeqChunk]) -> tuple[StepInputs, Bucket | None]:
        bucket = self.select_bucket(chunks)
        if bucket is None:
            return build_step_inputs(chunks, self.layout), None
        return self._static(chunks, bucket), bucket

    def to_device(self, step: StepInputs, bucket: Bucket | None) -> StepInputs:
        # a graph step stays on the host: forward copies it into the graph's persistent buffers
        step = host_inputs(self.model, step)
        return step_to(step, self.device) if bucket is None else step

    def _capture(self, bucket: Bucket, cache) -> _Graph:
        placeholder = host_inputs(self.model, self._static([], bucket))
        inputs = step_to(placeholder, self.device)   # on CPU (tests) the placeholder's own tensors
        out = self._outputs.get(bucket.num_tokens)
        if out is None:
            out = self._outputs[bucket.num_tokens] = torch.empty(
                bucket.num_tokens, self.model.head.weight.shape[0], dtype=torch.float32,   # the rank's vocabulary
                device=self.device)
        t0 = time.perf_counter()
        replay, output = self.capture(lambda: out.copy_(self.model(inputs, cache)))
        logger.info("captured a decode graph for %d rows, context %d, in %.2f s", bucket.num_tokens, bucket.context,
                    time.perf_counter() - t0)
        return _Graph(inputs, output, replay, static_signature(placeholder), cache)

    @torch.inference_mode()
    def warm_up(self, cache) -> int:
        """Capture every (row bucket, context bucket) graph now."""
        for bucket in self.buckets.all_buckets():
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket, cache)
        return self.num_graphs

    @torch.inference_mode()
    def forward(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        if bucket is None:
            self.eager_steps += 1
            return self.model(step, cache)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(bucket, cache)
        if graph.cache is not cache:
            raise RuntimeError("CudaGraphStrategy: a graph replays against the cache it was captured with")
        if static_signature(step) != graph.signature:
            raise RuntimeError(f"CudaGraphStrategy: step does not match the graph of bucket {bucket}")
        _copy_into(graph.inputs, step)
        graph.replay()
        self.replays += 1
        return graph.output
