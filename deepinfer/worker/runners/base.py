"""How a step's forward runs: the strategy contract the ModelRunner (worker/model_runner.py) drives.

A strategy picks a bucket for the step's chunks, builds the step's metadata (padded to the bucket
when it has one) and runs the model on it. The eager strategy needs no buckets and runs the step as
it is. Static-shape strategies (CUDA graphs, Neuron region graphs) pad rows with placeholder tokens
that read and write only the scratch slot and block (slot 0 / block 0); the ModelRunner slices the
real rows back out. Multi-token decode rows (speculative verification) are ordinary rows with
num_new > 1 and num_logits > 1.
"""
from __future__ import annotations

import torch

from deepinfer.model_executor.forward_meta import CacheLayout, SeqChunk, StepInputs, build_step_inputs, step_to
from deepinfer.model_executor.static_step import Bucket, BucketSpec


def host_inputs(model, step: StepInputs) -> StepInputs:
    """`step` with what the model reads from host memory gathered into it (DeepseekV4Model.host_inputs:
    the Engram rows), on every rank, before the copy to the device; every strategy's `to_device` runs it."""
    fill = getattr(model, "host_inputs", None)
    return step if fill is None else fill(step)


class RunnerStrategy:
    """Base class: eager, unpadded. Subclasses override `select_bucket`, `prepare` and `forward`."""
    name = "base"
    # each logits row's argmax from the latest `forward`, where its head computed it alongside the logits
    # (DeepseekV4Model.finish_argmax), else None: the sampler's greedy rows then skip scanning the logits.
    # ModelRunner.execute clears it before each forward; a forward that computes one sets it.
    row_argmax: torch.Tensor | None = None

    def __init__(self, model, layout: CacheLayout, platform=None, buckets: BucketSpec | None = None):
        self.model = model
        self.layout = layout
        self.platform = platform
        self.buckets = buckets
        # metadata is built on the host and copied to the model's device once per step
        param = next(model.parameters(), None) if model is not None else None
        self.device = param.device if param is not None else torch.device("cpu")

    def select_bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        return None

    def prepare(self, chunks: list[SeqChunk]) -> tuple[StepInputs, Bucket | None]:
        """The step's inputs (on the device, or host tensors a strategy copies in itself) and its bucket."""
        step, bucket = self.prepare_host(chunks)
        return self.to_device(step, bucket), bucket

    def prepare_host(self, chunks: list[SeqChunk]) -> tuple[StepInputs, Bucket | None]:
        """The step's host-built inputs and bucket: what a multi-rank driver publishes to its followers
        (executor/step_fanout.py) before `to_device`."""
        return build_step_inputs(chunks, self.layout), None

    def group_buckets(self, groups: list[list[SeqChunk]]) -> list[Bucket | None] | None:
        """The bucket of each data-parallel group's share of one step, all of one token count (None in
        the list: every group eager), for `prepare_host(chunks, bucket)`; None: each group's
        `prepare_host(chunks)` selects its own (no buckets here)."""
        return None

    def to_device(self, step: StepInputs, bucket: Bucket | None) -> StepInputs:
        """The host-built step where `forward` reads it (one copy per step), after its host stage."""
        return step_to(host_inputs(self.model, step), self.device)

    def forward(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        """Logits of every row of `step` (padding rows included)."""
        raise NotImplementedError

    def draft_rows(self, rows: int) -> int:
        """Rows a DSpark draft block of `rows` sequences runs as (placeholder rows pad the rest)."""
        return rows

    def draft_to_device(self, step: StepInputs):
        """A draft block's host-built inputs where `forward_draft` reads them."""
        return step_to(step, self.device)

    def forward_draft(self, step, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_pre, base logits) of every row of a draft block (padding rows included)."""
        return self.model.draft(step, cache)

    def draft_heads(self, hidden: torch.Tensor, base: torch.Tensor, prev_ids: torch.Tensor):
        """(logits, confidence) of one draft depth (models/dspark_draft.py draft_heads)."""
        return self.model.draft_heads(hidden, base, prev_ids)

    @property
    def greedy_drafts_in_graph(self) -> bool:
        """Whether `forward_draft_greedy` runs the heads with the draft block (neuron_regions.py); here
        the host samples the drafts (ModelRunner.draft_heads)."""
        return False

    @property
    def greedy_spec_on_device(self) -> bool:
        """Whether a greedy speculative step can run as one device program (`greedy_spec_inputs`,
        `greedy_spec_to_device`, `forward_greedy_spec`: neuron_regions.py); here the host verifies and
        the draft block is a second program (spec/decoder.py)."""
        return False

    def greedy_spec_inputs(self, chunks: list[SeqChunk], num_rows: int, bucket: Bucket | None = None):
        """(host StepInputs, bucket, block rows) of such a step, or None: the host verifies."""
        return None

    def warm_up(self, cache) -> int:
        """Build every bucket's graph now, from placeholder rows (scratch slot / block only); returns
        the number of graphs this strategy holds. The eager strategy has none."""
        return 0

    @property
    def num_graphs(self) -> int:
        return 0
