"""NeuronRegionStrategy: static-shape steps run through compiled layer regions (docs/architecture.md §1, docs/neuron.md §5.1-5.4).

Per step: pick a bucket (model_executor/static_step.py BucketSpec), pad the chunks with placeholder rows
(scratch slot 0 / block 0), build StepInputs on the host and give every data-dependent length a
static size (BucketSpec.static_step), pack the metadata into one buffer and copy it to the device once
(model_executor/step_pack.py), then run the model as compiled regions (neuron_ops/regions.py): the
step's entry (unpacking, prefix restores, embedding, RoPE tables), each decoder layer, the step's exit
(draft main keys, HC collapse, final norm, LM head over a fixed count of logits rows); a DSpark draft
block runs as one region of its own, its rows padded to a row bucket. One graph per (token bucket,
context bucket), layer kind and region (a multi-row step may run a layer as several sub-regions: the
split policy). A step that fits no bucket runs eagerly, unpadded; so does the exit of a step with more
logits rows than its bucket's fixed count (prompt logprobs). The graphs to compile are counted and
logged before any is (platforms/neuron/compile_plan.py). `census` (neuron_ops/op_census.py), when set,
counts what runs outside the regions and the copies, a step at a time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from deepinfer.model_executor import step_pack
from deepinfer.model_executor.forward_meta import SeqChunk, StepInputs, build_step_inputs, step_to
from deepinfer.model_executor.models.dspark_draft import (DraftBlock, draft_forward, draft_step_inputs,
                                                          greedy_drafts, pad_draft_tokens)
from deepinfer.model_executor.models.v4_common import StepContext
from deepinfer.model_executor.static_step import Bucket, BucketSpec, draft_block_tokens
from deepinfer.platforms.neuron import compile_cache
from deepinfer.platforms.neuron.compile_plan import exit_logits_rows, greedy_spec_rows, step_class
from deepinfer.spec.greedy_step import GreedySpecPlan, verify_and_draft
from deepinfer.worker.runners.base import RunnerStrategy, host_inputs
from deepinfer.worker.runners.warm_guards import WarmGuards

logger = logging.getLogger(__name__)


@dataclass
class PackedStep:
    """A bucketed step on the device: one int64 buffer and its StepLayout (model_executor/step_pack.py)."""
    buf: torch.Tensor
    layout: tuple
    compiled_exit: bool   # its logits rows are the bucket's fixed count (else the exit runs eagerly)
    # a step wanting more logits rows than that count: its rows, copied apart, so that the buffer keeps
    # the bucket's layout (and the entry graph)
    logits_indices: torch.Tensor | None = None
    draft_rows: int = 0   # of a draft block: its rows (sequences), the first draft_rows x B tokens


def _draft_key(step):
    """The warm-guards key of a draft block's step (None: an eager block)."""
    return ("draft", step.layout, step.draft_rows) if isinstance(step, PackedStep) else None


@dataclass
class GreedySpecInputs:
    """A greedy speculative step on the device (spec/greedy_step.py): the step's buffer and the plan's
    rows, views of one copy."""
    packed: PackedStep
    meta: torch.Tensor   # int64 [rows, 2B + 4]
    rows: int            # the draft block's rows (a verification row bucket)


def _entry(model, buf, layout, cache):
    step = step_pack.unpack(buf, layout)
    x, prev_pre, tables = model.begin(step, cache)
    return step_pack.leaves(step), x, prev_pre, tables


def _exit(model, state, ctx):
    """(logits, each row's argmax or None): DeepseekV4Model.finish_argmax."""
    return model.finish_argmax(state, ctx)


def _whole_step(model, buf, layout, cache):
    """A bucketed step with a compiled exit as one graph (compile scope "step",
    regions.COMPILE_SCOPES): what the entry, the layer regions and the exit run one after another, the
    decoder layers unrolled. Returns what `_exit` returns."""
    tensors, x, prev_pre, tables = _entry(model, buf, layout, cache)
    ctx = StepContext(model, step_pack.rebuild(layout, tensors), cache, tables)
    return model.finish_argmax(model.run_layers(x, prev_pre, ctx), ctx)


def _draft(model, buf, layout, cache, rows: int, depth: int):
    """A draft block as one region: (fp32 [R * B, D + C] = [hidden_pre | base logits over every draft
    column: the vocabulary, or a draft vocabulary's, models/draft_vocab.py] of the real block tokens, fp32 [rows, 2B] = the greedy drafts (as exact fp32 integers: ids < 2^24) and
    their confidences). The runner copies back one of the two: the rows when the host samples the
    drafts depth by depth, the greedy drafts when every row drafts by argmax (dspark_draft.greedy_drafts);
    both come from the same graph, so the plan keeps one draft graph a bucket."""
    step = step_pack.unpack(buf, layout)
    hidden, base = draft_forward(model, step, cache)
    n = rows * depth   # the real rows' tokens; the power-of-two padding's are dropped before the gather
    # a vocabulary-split head's slice gathered over the CP group, in-graph ([n, V] fp32: 158 MiB at
    # V4.1-Flash, 64 rows x 5, against 252 MiB for all 512 padded tokens; §4 B7)
    hidden, base = hidden[:n], model.draft_columns(base[:n])
    first = step.input_ids[:n].view(rows, depth)[:, 0]
    drafts, conf = greedy_drafts(model, hidden, base, first, depth)
    return torch.cat([hidden.float(), base], dim=1), torch.cat([drafts.float(), conf], dim=1)


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
        self.census = None   # an OpCensus (neuron_ops/op_census.py) to count eager ops and copies
        # the cpu platform's compiled step skips Dynamo's non-tensor guards on warm steps (warm_guards.py)
        self.warm_guards = WarmGuards(lambda: self.num_graphs, enabled=self.regions is not None
                                      and bool(getattr(platform, "skip_warm_guards", False)))
        # RoPE keeps its inverse frequencies per device, made on first use: make them now, so the entry
        # region's first trace does not guard on that cache being empty (and retrace on the next step)
        for rot in getattr(model, "rotary", {}).values():
            rot.cos_sin(torch.zeros(0, dtype=torch.long, device=platform.device))
        self.plan = None
        if self.regions is not None:
            from deepinfer.neuron_ops.regions import layer_kind
            from deepinfer.platforms.neuron.compile_plan import compile_plan
            self.plan = compile_plan(buckets, [layer_kind(layer) for layer in model.layers], self.regions.split,
                                     drafts=self.drafts, scope=self.regions.scope)
            # one line a host: every rank of it compiles the same plan
            log = logger.info if getattr(platform, "rank", 0) == 0 else logger.debug
            log("Neuron compile plan: %s", self.plan.describe())

    def select_bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        return self.buckets.select(chunks)

    @property
    def drafts(self) -> int:
        """B: the DSpark draft block's tokens per row (the verification rows' 1 + B, less one)."""
        return max(0, self.buckets.verify_tokens - 1)

    def group_buckets(self, groups: list[list[SeqChunk]]) -> list[Bucket | None]:
        return self.buckets.common_buckets(groups)

    def prepare_host(self, chunks: list[SeqChunk], bucket: Bucket | None = None) -> tuple[StepInputs, Bucket | None]:
        bucket = bucket or self.select_bucket(chunks)
        if bucket is None:
            return build_step_inputs(chunks, self.layout), None
        rows = exit_logits_rows(bucket, self.buckets)
        wanted = sum(min(c.num_logits, c.num_new) for c in chunks)
        step = self.buckets.static_step(chunks, bucket, self.layout, logits_rows=rows if wanted <= rows else None)
        return step, bucket

    def to_device(self, step: StepInputs, bucket: Bucket | None):
        # the Engram hash and row fetch are host work: before the census opens the step's device count
        step = host_inputs(self.model, step)
        if self.census is not None:
            self.census.open_step("eager" if bucket is None else
                                  f"{self.plan.step_of(bucket) if self.plan else 'step'} {bucket.num_tokens}x{bucket.context}")
            self.census.phase("step")
        if bucket is None or self.regions is None:
            self._copied(len(step_pack.leaves(step)))
            return step_to(step, self.platform.device)
        rows = exit_logits_rows(bucket, self.buckets)
        if step.logits_indices.numel() == rows:
            return self._packed(step, True)
        extra = step.logits_indices
        self._copied(1)
        placeholder = torch.zeros(rows, dtype=extra.dtype)
        return dataclasses.replace(self._packed(dataclasses.replace(step, logits_indices=placeholder), False),
                                   logits_indices=extra.to(self.platform.device, non_blocking=True))

    def _packed(self, step: StepInputs, compiled_exit: bool) -> PackedStep:
        buf, layout = step_pack.pack(step)
        self._copied(1)
        return PackedStep(buf.to(self.platform.device, non_blocking=True), layout, compiled_exit)

    def _copied(self, n: int) -> None:
        if self.census is not None:
            self.census.host_to_device(n)

    def _returned(self, n: int) -> None:
        if self.census is not None:
            self.census.device_to_host(n)

    @contextlib.contextmanager
    def _counting(self):
        """The census (and the fp8 guard) active for eager code; region calls pop them (`_region`)."""
        with contextlib.ExitStack() as stack:
            if self.fp8_guard is not None:
                stack.enter_context(self.fp8_guard)
            if self.census is not None:
                stack.enter_context(self.census)
            yield
        if self.fp8_guard is not None:
            self._log_new_fp8_sites()

    def _outside(self):
        """Pops what `_counting` pushed, around a compiled region call."""
        stack = contextlib.ExitStack()
        if self.census is not None:
            stack.enter_context(self.census.paused())
        if self.fp8_guard is not None:
            from torch.overrides import _pop_mode_temporarily
            stack.enter_context(_pop_mode_temporarily())
        return stack

    def _region(self, name: str, fn, *args):
        with self._outside():
            return self.regions.run_top(name, fn, *args)

    def _hook(self, run_layer):
        if run_layer is None:
            return None

        def call(*args):
            with self._outside():
                return run_layer(*args)
        return call

    # -- DSpark draft blocks ------------------------------------------------------------------
    def draft_rows(self, rows: int) -> int:
        """Rows a draft block of `rows` sequences runs as: the smallest row bucket that holds them."""
        if self.regions is None:
            return rows
        fits = [b for b in self.buckets.batch if b >= rows]
        return min(fits) if fits else rows

    def draft_tokens(self, rows: int) -> int:
        """Tokens a draft block of `rows` (a row bucket) runs as: rows x B up to a power of two (§4 B3)."""
        return draft_block_tokens(rows, self.drafts)

    def draft_to_device(self, step: StepInputs):
        if self.census is not None:
            self.census.phase("draft")
        rows = step.input_ids.numel() // max(1, self.drafts)
        if self.regions is None or self.drafts == 0 or rows not in self.buckets.batch:
            self._copied(len(step_pack.leaves(step)))
            return step_to(step, self.platform.device)
        padded = pad_draft_tokens(step, self.draft_tokens(rows), self.layout)
        return dataclasses.replace(self._packed(dataclasses.replace(padded, static_shapes=True), True),
                                   draft_rows=rows)

    def _draft_region(self, step: PackedStep, cache):
        return self._region("draft", _draft, self.model, step.buf, step.layout, cache, step.draft_rows, self.drafts)

    @torch.inference_mode()
    def forward_draft(self, step, cache) -> tuple[torch.Tensor, torch.Tensor]:
        with self._counting(), self.warm_guards.step(_draft_key(step)):
            if isinstance(step, PackedStep):
                rows, _ = self._draft_region(step, cache)
                d = self.model.cfg.hidden_size
                hidden, base = rows[:, :d].to(self.model.dtype), rows[:, d:]
                self._returned(1)
            else:
                hidden, base = self.model.draft(step, cache)
                self._returned(2)
        return hidden, base

    def draft_heads(self, hidden, base, prev_ids):
        """The per-depth Markov and confidence heads of rows the host samples (spec/proposer.py: a block
        whose rows do not all draft by argmax) run eagerly, the sampler between depths on the host."""
        if self.census is not None:
            self.census.phase("heads")
        with self._counting():
            out = self.model.draft_heads(hidden, base, prev_ids)
            self._returned(len(out))
        return out

    @property
    def greedy_drafts_in_graph(self) -> bool:
        """Whether `forward_draft_greedy` runs the heads in the draft block's region (compiled steps)."""
        return self.regions is not None and self.drafts > 0

    @torch.inference_mode()
    def forward_draft_greedy(self, step, cache) -> torch.Tensor:
        """fp32 [R, 2B] = [drafts (exact fp32 integers) | confidences] of a draft block whose rows all
        draft by argmax, on the device: the per-depth heads run inside the block's region and only this
        comes back (one copy, ModelRunner.execute_draft_greedy, after the group leaders' gather). A
        block that fits no row bucket runs the same function eagerly."""
        b = self.drafts
        with self._counting(), self.warm_guards.step(_draft_key(step)):
            if isinstance(step, PackedStep):
                _, out = self._draft_region(step, cache)
            else:
                hidden, base = self.model.draft(step, cache)
                first = step.input_ids.view(-1, b)[:, 0]
                out = torch.cat([t.float() for t in greedy_drafts(self.model, hidden, base, first, b)], dim=1)
            self._returned(1)
        return out

    # -- greedy speculative steps on the device (spec/greedy_step.py) ----------------------------
    @property
    def greedy_spec_on_device(self) -> bool:
        return self.regions is not None and self.drafts > 0

    def greedy_spec_inputs(self, chunks: list[SeqChunk], num_rows: int,
                           bucket: Bucket | None = None) -> tuple[StepInputs, Bucket, int] | None:
        """(host StepInputs, bucket, block rows) of a verification step whose `num_rows` sampling rows are
        all greedy (spec/decoder.py decides), to run as one device program: the forward's regions, then
        the `verify_draft` region (acceptance and the next draft block). None where the step is not in a
        verification bucket with a compiled exit (a planned `verify_draft` graph): the decoder then
        verifies on the host. On a model over ranks each data-parallel group asks with the largest
        group's row count, so every group runs the same block rows (its MoE collectives), and with the
        bucket the driver chose for it (BucketSpec.common_buckets)."""
        if not self.greedy_spec_on_device:
            return None
        bucket = bucket or self.select_bucket(chunks)
        rows = None if bucket is None else greedy_spec_rows(bucket, self.buckets, num_rows)
        if rows is None:
            return None
        step, bucket = self.prepare_host(chunks, bucket)
        if step.logits_indices.numel() != exit_logits_rows(bucket, self.buckets):
            return None
        return step, bucket, rows

    def greedy_spec_to_device(self, step: StepInputs, bucket: Bucket, meta: torch.Tensor) -> GreedySpecInputs:
        """One copy in: the step's metadata, then the plan's rows (GreedySpecPlan.meta), one buffer whose
        views go to the two graphs."""
        step = host_inputs(self.model, step)
        if self.census is not None:
            self.census.open_step(f"verify_draft {bucket.num_tokens}x{bucket.context}")
            self.census.phase("step")
        buf, layout = step_pack.pack(step)
        both = torch.cat([buf, meta.reshape(-1)]).to(self.platform.device, non_blocking=True)
        self._copied(1)
        return GreedySpecInputs(PackedStep(both[:buf.numel()], layout, True), both[buf.numel():].view(meta.shape),
                                int(meta.shape[0]))

    def greedy_spec_buckets(self) -> list[tuple[Bucket, int]]:
        """(verification bucket, block rows) of every planned `verify_draft` graph, at the largest context
        (its graph does not depend on the context: it reads the exit's logits and the window rings)."""
        if not self.drafts or not hasattr(self.model, "mtp"):
            return []
        ctx = max(self.buckets.context_ladder())
        return [(self.buckets._verify_bucket([], rows, ctx), rows) for rows in self.buckets.verify_batch]

    def greedy_spec_placeholders(self, bucket: Bucket, rows: int, cache) -> torch.Tensor:
        """A placeholder-only greedy speculative step (warm-up, the device report): the verification
        bucket's forward and its `verify_draft` region, scratch slot only."""
        step = self.buckets.static_step([], bucket, self.layout, logits_rows=exit_logits_rows(bucket, self.buckets))
        plan = GreedySpecPlan([], [], [], [], [], self.drafts)
        return self.forward_greedy_spec(self.greedy_spec_to_device(step, bucket, plan.meta(rows)), cache, bucket)

    @torch.inference_mode()   # as `forward`: the regions' graphs are traced under inference mode
    def forward_greedy_spec(self, inputs: GreedySpecInputs, cache, bucket: Bucket) -> torch.Tensor:
        """fp32 [rows, 3B + 2] (spec/greedy_step.verify_and_draft) of every plan row, placeholders last,
        on the device: the one copy back is ModelRunner.execute_greedy_spec's, after the group leaders'
        gather."""
        noise, packed, meta, rows = int(self.model.cfg.dspark_noise_token_id), inputs.packed, inputs.meta, inputs.rows
        with self._counting(), self.warm_guards.step(("spec", bucket, packed.layout, rows)):
            logits, _ = self._compiled_forward(packed, cache, self._hook(self._layer_hook(bucket)))
            if self.census is not None:
                self.census.phase("draft")
            # acceptance and the next draft block: the verification logits never leave the device
            out = self._region("verify_draft", verify_and_draft, self.model, logits, meta, cache, self.layout, noise,
                               self.draft_tokens(rows))
            self._returned(1)
        return out

    def _layer_hook(self, bucket: Bucket):
        """The region runner's per-layer hook of a bucketed step (regions.RegionRunner.hook)."""
        self.buckets_seen.add((bucket.num_tokens, bucket.context))
        prompt = step_class(bucket, self.buckets) == "prefill"
        return None if self.regions is None else self.regions.hook(bucket.num_seqs, bucket.num_tokens, prompt)

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
            step = self.buckets.static_step([], bucket, self.layout, logits_rows=exit_logits_rows(bucket, self.buckets))
            self.forward(self.to_device(step, bucket), cache, bucket)
        if self.drafts and hasattr(self.model, "mtp"):
            noise = int(self.model.cfg.dspark_noise_token_id)
            for rows in self.buckets.batch:
                block = DraftBlock([], [], [], self.drafts).padded(rows)
                self.forward_draft(self.draft_to_device(draft_step_inputs(block, self.layout, noise)), cache)
            for bucket, rows in self.greedy_spec_buckets():
                self.greedy_spec_placeholders(bucket, rows, cache)
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

    @torch.inference_mode()
    def forward(self, step, cache, bucket: Bucket | None) -> torch.Tensor:
        """step: a PackedStep (bucketed, compiled) or a StepInputs (`to_device` of an eager step)."""
        if bucket is None:
            self.eager_steps += 1
            if self.eager_steps == 1:
                logger.warning("a step fits no Neuron bucket (%s); running it eagerly", self.buckets)
            run_layer = None
        else:
            run_layer = self._layer_hook(bucket)
        graphs_before, t0 = self.num_graphs, time.perf_counter()
        key = (("step", bucket, step.layout, step.compiled_exit, step.logits_indices is None)
               if bucket is not None and isinstance(step, PackedStep) else None)
        with self._counting(), self.warm_guards.step(key):
            if isinstance(step, PackedStep):
                logits, row_argmax = self._compiled_forward(step, cache, self._hook(run_layer))
            else:
                logits, row_argmax = self.model(step, cache, run_layer=self._hook(run_layer)), None
            self._returned(1)
        if self.num_graphs > graphs_before:   # only a bucketed step compiles regions
            logger.info("compiled %d region graphs for a step of %d tokens, context %d, in %.2f s (with its run)",
                        self.num_graphs - graphs_before, bucket.num_tokens, bucket.context, time.perf_counter() - t0)
        if logits.device.type in ("cpu", "meta"):   # meta: the device report
            self.row_argmax = row_argmax
            return logits
        return logits.cpu()   # the sampler scans the logits on the host (row_argmax stays None)

    def _compiled_forward(self, packed: PackedStep, cache, run_layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, each row's argmax or None)."""
        model = self.model
        if self.regions.scope == "step" and packed.compiled_exit:
            return self._region("step", _whole_step, model, packed.buf, packed.layout, cache)
        # a step whose logits rows exceed its exit's (prompt logprobs) runs the layer regions, exit eager
        tensors, x, prev_pre, tables = self._region("entry", _entry, model, packed.buf, packed.layout, cache)
        step = step_pack.rebuild(packed.layout, tensors)
        if packed.logits_indices is not None:
            step = dataclasses.replace(step, logits_indices=packed.logits_indices)
        ctx = StepContext(model, step, cache, tables)
        state = model.run_layers(x, prev_pre, ctx, run_layer)
        if packed.compiled_exit:
            return self._region("exit", _exit, model, state, ctx)
        return model.finish(state, ctx), None

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
