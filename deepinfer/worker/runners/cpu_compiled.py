"""CpuCompiledStrategy: decode and verification steps through compiled decoder-layer regions on the
CPU platform (platforms/cpu.py, DEEPINFER_CPU_COMPILE=1).

The Neuron host-mode strategy (worker/runners/neuron_regions.py) with the CPU platform's buckets and
backend: each decode or verification step is padded to its (rows, context) bucket with placeholder
rows (scratch slot 0 / block 0), its metadata given static sizes (model_executor/static_step.py), and
the whole step (entry, every decoder layer, exit) runs as one graph per bucket, or with
DEEPINFER_CPU_COMPILE_SCOPE=layer as Neuron's regions, one graph per (layer kind, bucket) plus the
entry and exit (neuron_ops/regions.py COMPILE_SCOPES), compiled by torch.compile (inductor by default:
the mHC Sinkhorn iterations, the hyper-connection pre/post and the other elementwise work of a layer
become a few generated loops around the GEMMs). One graph a step is the default because each graph
call costs Dynamo's entry and inductor's Python wrapper (README "Compiled CPU decode step").
Prompt steps run eagerly unless DEEPINFER_CPU_PREFILL_BUCKETS names prompt buckets (then a prompt
step of at most the largest is padded to one and runs as that bucket's graph, like Neuron's prompt
chunks); eager prompt steps use the kernel table's elementwise kernels (mHC mixes,
pre / post, RMSNorm, RoPE, the compressor's pooling, the sink attention's query chunks) compiled once,
only their token dimension dynamic (prompt_kernels.py). The compile cost is paid when a bucket (or the
first prompt step) first runs, or at start-up with EngineConfig.warmup_graphs (the worker logs the
seconds; `compile_s` sums them).
"""
from __future__ import annotations

import logging
import time

import torch

from deepinfer.model_executor.forward_meta import step_to
from deepinfer.platforms.neuron.compile_plan import exit_logits_rows
from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
from deepinfer.worker.runners.prompt_kernels import fused_kernel_table, kernels_of


logger = logging.getLogger(__name__)


class CpuCompiledStrategy(NeuronRegionStrategy):
    name = "cpu_compiled"

    def __init__(self, model, layout, platform, buckets, compile: bool = True, regions=None):
        super().__init__(model, layout, platform, buckets, compile=compile, regions=regions)
        self.compile_s = 0.0   # seconds of the steps that compiled a graph (their own run included)
        self.prompt_kernels = None if self.regions is None else fused_kernel_table(model.kernels,
                                                                                    self.regions.backend)
        self.fused_prompt_steps = 0   # prompt steps run with the fused kernel table
        self._prompt_kernels_built = False   # compiled by warm_up or the first prompt step

    def forward(self, step, cache, bucket):
        if bucket is None:   # a prompt step outside the prompt buckets (if any): eager by design
            self.eager_steps += 1
            if self.prompt_kernels is None:
                return self.model(step, cache)
            self.fused_prompt_steps += 1
            t0 = time.perf_counter()
            with kernels_of(self.model, self.prompt_kernels):
                logits = self.model(step, cache)
            if not self._prompt_kernels_built:   # this step compiled the fused kernels
                self._prompt_kernels_built = True
                self.compile_s += time.perf_counter() - t0
            return logits
        before, t0 = self.num_graphs, time.perf_counter()
        logits = super().forward(step, cache, bucket)
        if self.num_graphs > before:
            self.compile_s += time.perf_counter() - t0
        return logits

    @torch.inference_mode()
    def warm_up(self, cache) -> int:
        """The region graphs of every bucket (NeuronRegionStrategy.warm_up), then the fused prompt
        kernels: the largest row bucket's placeholder step (scratch slot only) runs eagerly with the fused
        table, which compiles each kernel with its token dimension symbolic. A prompt chunk's attention
        may still compile once more on first use (its record count differs from a decode row's)."""
        graphs = super().warm_up(cache)
        if self.prompt_kernels is not None:
            bucket = max((b for b in self.buckets.all_buckets() if b.num_seqs == b.num_tokens),
                         key=lambda b: (b.num_tokens, b.context))
            step = self.buckets.static_step([], bucket, self.layout, logits_rows=exit_logits_rows(bucket, self.buckets))
            t0 = time.perf_counter()
            with kernels_of(self.model, self.prompt_kernels):
                self.model(step_to(step, self.platform.device), cache)
            self._prompt_kernels_built = True
            seconds = time.perf_counter() - t0
            self.compile_s += seconds
            logger.info("warm-up: the fused prompt-step kernels compiled in %.1f s", seconds)
        return graphs
