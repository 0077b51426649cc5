"""NeuronRegionStrategy: static-shape steps run through compiled layer regions (docs/architecture.md §1, docs/neuron.md §5.1-5.4).

Per step: pick a bucket (model_executor/static_step.py BucketSpec), pad the chunks with placeholder rows
(scratch slot 0 / block 0), build StepInputs on the host and give every data-dependent length a
static size (BucketSpec.static_step), copy the metadata to the device once, then run the model with
its decoder layers as compiled regions (neuron_ops/regions.py); the top level (embedding, head) stays
eager. One graph per (token bucket, context bucket), layer kind and region (a multi-row step may run
a layer as several sub-regions: the split policy). A step that fits no bucket runs eagerly, unpadded.
The graphs to compile are counted and logged before any is (platforms/neuron/compile_plan.py).
"""
from __future__ import annotations

import logging
import time

import torch

from deepinfer.model_executor.forward_meta import SeqChunk, StepInputs, build_step_inputs, step_to
from deepinfer.model_executor.static_step import Bucket, BucketSpec
from deepinfer.platforms.neuron import compile_cache
from deepinfer.worker.runners.base import RunnerStrategy, host_inputs

logger = logging.getLogger(__name__)


class NeuronRegionStrategy(RunnerStrategy):
    name = "neuron_regions"

    def __init__(self, model, layout, platform, buckets: BucketSpec, compile: bool = True, regions=None):
        """platform: the NeuronPlatform (device, compile backend, fp8 guard); buckets: its bucket_spec.
        regions: a RegionRunner to share (its compiled graphs serve every model with the same layer kinds)."""
        super().__init__(model, layout, platform, buckets)
        if platform is None or buckets is None:
            raise ValueError("NeuronRegionStrategy: needs the NeuronPlatform and its BucketSpec")
        self.compile = compile
        self.regions = (regions or platform.region_runner()) if compile else None
        self.eager_steps = 0
        # DEEPINFER_NEURON_FP8_GUARD: eager code runs under Fp8Guard; region graphs are scanned at compile
        self.fp8_guard = None
        if platform.fp8_guard:
            from deepinfer.neuron_ops.fp8_guard import Fp8Guard
            self.fp8_guard = Fp8Guard()
        self._fp8_logged: set[str] = set()
        self.buckets_seen: set[tuple[int, int]] = set()  # (tokens, context) of compiled steps
        self.plan = None
        if self.regions is not None:
            from deepinfer.neuron_ops.regions import layer_kind
            from deepinfer.platforms.neuron.compile_plan import compile_plan
            self.plan = compile_plan(buckets, [layer_kind(layer) for layer in model.layers], self.regions.split)
            # one line a host: every rank of it compiles the same plan
            log = logger.info if getattr(platform, "rank", 0) == 0 else logger.debug
            log("Neuron compile plan: %s", self.plan.describe())

    def select_bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        return self.buckets.select(chunks)

    def prepare_host(self, chunks: list[SeqChunk]) -> tuple[StepInputs, Bucket | None]:
        bucket = self.select_bucket(chunks)
        step = (build_step_inputs(chunks, self.layout) if bucket is None
                else self.buckets.static_step(chunks, bucket, self.layout))
        return step, bucket

    def to_device(self, step: StepInputs, bucket: Bucket | None) -> StepInputs:
        return step_to(host_inputs(self.model, step), self.platform.device)

    @torch.inference_mode()
    def warm_up(self, cache) -> int:
        """Compile every (bucket, layer kind) region graph from placeholder-only steps. Under inference
        mode, as ModelRunner.run runs: Dynamo guards on the metadata tensors' dispatch keys, so graphs
        traced from normal tensors would be traced again for the engine's inference tensors."""
        if self.regions is None:
            return 0
        before, t0 = self.num_graphs, time.perf_counter()
        cache_dir = getattr(self.platform, "compile_cache_dir", None)
        neffs = compile_cache.neff_files(cache_dir)
        for bucket in self.buckets.all_buckets():
            step = self.buckets.static_step([], bucket, self.layout)
            self.forward(self.to_device(step, bucket), cache, bucket)
        self._log_warm_up(self.num_graphs - before, time.perf_counter() - t0, cache_dir, neffs)
        return self.num_graphs

    def _log_warm_up(self, compiled: int, seconds: float, cache_dir: str | None, neffs_before: int) -> None:
        """Compiled here vs already compiled: Dynamo counts this process's graphs (a shared RegionRunner
        compiled the rest); on a device the NEFF files the compiler added to the cache count the
        graphs neuronx-cc compiled rather than read back."""
        planned = self.plan.graph_count
        if compiled > planned:
            logger.warning("warm-up compiled %d region graphs, more than the %d planned: the compile plan "
                           "(platforms/neuron/compile_plan.py) misses some", compiled, planned)
        logger.info("warm-up: %d of the %d planned region graphs traced and compiled in %.1f s, %d already "
                    "compiled in this process", compiled, planned, seconds, max(0, planned - compiled))
        if cache_dir is None:
            return
        if self.platform.is_host_mode:
            logger.info("warm-up: host mode compiles with the CPU backend: nothing written to the compile cache "
                        "%s (on a device it would hold the NEFFs of these %d graphs)", cache_dir, planned)
        else:
            added = compile_cache.neff_files(cache_dir) - neffs_before
            logger.info("warm-up: the compile cache %s gained %d NEFF files (graphs neuronx-cc compiled); "
                        "%d traced graphs were served without a new NEFF", cache_dir, added, max(0, compiled - added))

    def forward(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        if bucket is None:
            self.eager_steps += 1
            if self.eager_steps == 1:
                logger.warning("a step fits no Neuron bucket (%s); running it eagerly", self.buckets)
            run_layer = None
        else:
            self.buckets_seen.add((bucket.num_tokens, bucket.context))
            run_layer = None if self.regions is None else self.regions.hook(bucket.num_seqs, bucket.num_tokens)
        graphs_before, t0 = self.num_graphs, time.perf_counter()
        if self.fp8_guard is None:
            logits = self.model(step, cache, run_layer=run_layer)
        else:
            with self.fp8_guard:
                logits = self.model(step, cache, run_layer=_outside_mode(run_layer))
            self._log_new_fp8_sites()
        if self.num_graphs > graphs_before:   # only a bucketed step compiles regions
            logger.info("compiled %d region graphs for a step of %d tokens, context %d, in %.2f s (with its run)",
                        self.num_graphs - graphs_before, bucket.num_tokens, bucket.context, time.perf_counter() - t0)
        return logits if logits.device.type == "cpu" else logits.cpu()

    def _log_new_fp8_sites(self) -> None:
        for line in self.fp8_sites():
            if line not in self._fp8_logged:
                self._fp8_logged.add(line)
                logger.warning("DEEPINFER_NEURON_FP8_GUARD: %s", line)

    def fp8_sites(self) -> list[str]:
        """Unsafe float8 ops seen so far (unique): eager call sites (guard on) and compiled region graphs,
        with every float8 value of a region graph (docs/neuron.md §4 A9)."""
        eager = [f"{op} on float8 at {site}" for op, site in self.fp8_guard.report.sites] if self.fp8_guard else []
        stats = self.regions.stats if self.regions is not None else None
        graphs = stats.fp8_sites + [f"float8 value: {s}" for s in stats.float8_sites] if stats else []
        return sorted(set(eager) | set(graphs))

    @property
    def num_graphs(self) -> int:
        """Region graphs compiled by this runner so far."""
        return 0 if self.regions is None else self.regions.stats.total_graphs


def _outside_mode(run_layer):
    """Call compiled regions with the guard's TorchFunctionMode popped (Dynamo would trace the mode;
    region graphs are checked by graph_fp8_sites instead)."""
    if run_layer is None:
        return None

    def call(*args):
        from torch.overrides import _pop_mode_temporarily
        with _pop_mode_temporarily():
            return run_layer(*args)
    return call
