"""CpuCompiledStrategy: decode and verification steps through compiled decoder-layer regions on the
CPU platform (platforms/cpu.py, DEEPINFER_CPU_COMPILE=1).

The Neuron host-mode strategy (worker/runners/neuron_regions.py) with the CPU platform's buckets and
backend: each decode or verification step is padded to its (rows, context) bucket with placeholder
rows (scratch slot 0 / block 0), its metadata given static sizes (model_executor/static_step.py), and
every decoder layer runs as one region graph per (layer kind, bucket) (neuron_ops/regions.py),
compiled by torch.compile (inductor by default: the mHC Sinkhorn iterations, the hyper-connection
pre/post and the other elementwise work of a layer become a few generated loops around the GEMMs).
Prompt steps fit no bucket and run eagerly. The compile cost is paid when a bucket is first used,
or at start-up with EngineConfig.warmup_graphs (the worker logs the seconds; `compile_s` sums them).
"""
from __future__ import annotations

import time

from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy


class CpuCompiledStrategy(NeuronRegionStrategy):
    name = "cpu_compiled"

    def __init__(self, model, layout, platform, buckets, compile: bool = True, regions=None):
        super().__init__(model, layout, platform, buckets, compile=compile, regions=regions)
        self.compile_s = 0.0   # seconds of the steps that compiled a graph (their own run included)

    def forward(self, step, cache, bucket):
        if bucket is None:   # a prompt step: eager by design, not a missing bucket
            self.eager_steps += 1
            return self.model(step, cache)
        before, t0 = self.num_graphs, time.perf_counter()
        logits = super().forward(step, cache, bucket)
        if self.num_graphs > before:
            self.compile_s += time.perf_counter() - t0
        return logits
