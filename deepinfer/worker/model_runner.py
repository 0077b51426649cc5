"""ModelRunner: the one entry point of a step, for the engine and the tests alike.

    run(chunks, samples, scores) = prepare -> execute -> score -> sample

- prepare: the strategy picks a bucket, builds the host metadata (padded to the bucket when there is
  one) and moves it to the device;
- execute: the strategy runs the forward (eager, CUDA-graph replay or Neuron region graphs) and the
  real rows' logits are sliced out (padding rows always come after the real rows);
- sample: the Sampler draws one token per logits row.

A rank that runs the step without sampling passes `samples=None` and gets the logits only. On a
model spread over ranks (worker/step_fanout.py), `run` is the driver's entry: prepare builds every
data-parallel group's rows, `publish` hands them to the followers (which run the same `execute`
from their `follow` loop and never sample), and execute gathers every group's real logits rows back
into chunk order before the driver scores and samples.

A chunk can also score known tokens (prompt logprobs): a ScoreRequest claims the first rows of
its chunk's logits rows, which then take no SampleRequest (layers/token_scores.py). Rows are
SeqChunks, so a multi-token decode row (speculative verification) is a chunk with num_new > 1 and
num_logits > 1; worker/spec_decode.py runs such steps without samples and verifies those rows
(layers/spec_verify.py), sampling the other rows through `sample`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.distributed.step_codec import KIND_DRAFT
from deepinfer.model_executor.forward_meta import SeqChunk, StepInputs, step_to
from deepinfer.model_executor.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from deepinfer.model_executor.layers.token_scores import TokenScores, score_tokens
from deepinfer.model_executor.models.dspark_draft import draft_step_inputs
from deepinfer.model_executor.static_step import Bucket
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.runners.base import RunnerStrategy


@dataclass(frozen=True)
class SampleRequest:
    """How one logits row is sampled."""
    params: SamplingParams
    position: int                    # position of the token being produced (keys seeded draws)
    seed: int | None = None          # None: params.seed, else a random one
    banned_ids: tuple[int, ...] = ()  # ids this row may not produce (stop_rules.banned_token_ids)
    # Token history, read only when params set a penalty (the worker passes the live lists).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    bitmask: torch.Tensor | None = None  # int32 [W] allowed-token words under a grammar


@dataclass(frozen=True)
class ScoreRequest:
    """The first len(target_ids) logits rows of chunk `chunk` score known tokens: row r is the
    distribution the model gave to target_ids[r] (the token after that row's position)."""
    chunk: int                       # index into the step's chunks
    target_ids: tuple[int, ...]
    num_top: int = 0                 # k of the top lists


@dataclass
class PreparedStep:
    step: StepInputs
    bucket: Bucket | None
    num_logits: int   # real logits rows (the strategy may return more: padding rows)
    fanout: object = None  # step_fanout.FanoutStep: the whole step's share-out over ranks (None: one rank)


@dataclass
class StepOutput:
    logits: torch.Tensor               # [num_logits, vocab] fp32, real rows in chunk order
    sampled: SamplerOutput | None      # None when the step was run without sampling
    scores: list[TokenScores] | None = None  # one per ScoreRequest, in order


@dataclass
class StepTiming:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, model, cache, layout, strategy: RunnerStrategy, sampler: Sampler | None = None,
                 fanout=None):
        """fanout: a step_fanout.StepFanout when the model runs on several ranks."""
        self.model = model
        self.cache = cache
        self.layout = layout
        self.strategy = strategy
        self.sampler = sampler or Sampler()
        self.fanout = fanout
        self.last_timing = StepTiming()

    def prepare(self, chunks: list[SeqChunk]) -> PreparedStep:
        if self.fanout is not None:
            return self.fanout.prepare(self.strategy, chunks)
        step, bucket = self.strategy.prepare(chunks)
        return PreparedStep(step, bucket, sum(min(c.num_logits, c.num_new) for c in chunks))

    def publish(self, prepared: PreparedStep) -> None:
        """Hand the step to the followers (a no-op on one rank)."""
        if self.fanout is not None:
            self.fanout.publish(prepared)

    def execute(self, prepared: PreparedStep) -> torch.Tensor:
        logits = self.strategy.forward(prepared.step, self.cache, prepared.bucket)
        logits = logits[: prepared.num_logits]
        if prepared.fanout is not None:
            logits = self.fanout.gather(prepared, logits)
        return logits

    def sample(self, logits: torch.Tensor, samples: list[SampleRequest]) -> SamplerOutput:
        if len(samples) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows but {len(samples)} sample requests")
        batch = SamplingBatch.build([s.params for s in samples], [s.position for s in samples],
                                    seeds=[s.seed for s in samples],
                                    banned_ids_per_row=[s.banned_ids for s in samples], device=logits.device,
                                    output_ids_per_row=[s.output_token_ids for s in samples],
                                    prompt_ids_per_row=[s.prompt_token_ids for s in samples],
                                    bitmask_per_row=[s.bitmask for s in samples])
        return self.sampler.forward(logits, batch)

    def score(self, logits: torch.Tensor, chunks: list[SeqChunk],
              scores: list[ScoreRequest]) -> tuple[list[TokenScores], torch.Tensor]:
        """Scores of each request, and the logits rows left for sampling (in chunk order)."""
        starts, row = [], 0
        for c in chunks:
            starts.append(row)
            row += min(c.num_logits, c.num_new)
        keep = torch.ones(logits.shape[0], dtype=torch.bool)
        results = []
        for req in scores:
            first, n = starts[req.chunk], len(req.target_ids)
            own = min(chunks[req.chunk].num_logits, chunks[req.chunk].num_new)
            if n > own:
                raise ValueError(f"chunk {req.chunk} has {own} logits rows, {n} scored")
            targets = torch.tensor(req.target_ids, dtype=torch.long)
            results.append(score_tokens(logits[first:first + n], targets, req.num_top))
            keep[first:first + n] = False
        rest = logits if bool(keep.all()) else logits[keep.nonzero().squeeze(1).to(logits.device)]
        return results, rest

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], samples: list[SampleRequest] | None = None,
            scores: list[ScoreRequest] | None = None) -> StepOutput:
        t0 = time.perf_counter()
        prepared = self.prepare(chunks)
        self.publish(prepared)
        t1 = time.perf_counter()
        logits = self.execute(prepared)
        t2 = time.perf_counter()
        scored, sample_logits = (None, logits) if not scores else self.score(logits, chunks, scores)
        sampled = None if samples is None else self.sample(sample_logits, samples)
        t3 = time.perf_counter()
        self.last_timing = StepTiming(t1 - t0, t2 - t1, t3 - t2)
        return StepOutput(logits, sampled, scored)

    @torch.inference_mode()
    def draft(self, block, noise_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_pre [R*B, D], base logits [R*B, V] fp32) of one DSpark draft block
        (models/dspark_draft.py DraftBlock), rows in block order. On a model spread over ranks the
        block is published first and every rank runs it (its MoE and lane attention have collectives)."""
        if self.fanout is None:
            step = step_to(draft_step_inputs(block, self.layout, noise_id), self.strategy.device)
            return self.model.draft(step, self.cache)
        prepared = self.fanout.prepare_draft(self.strategy, block, noise_id)
        self.publish(prepared)
        return self.execute_draft(prepared)

    def execute_draft(self, prepared: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, base = self.model.draft(prepared.step, self.cache)
        d = hidden.shape[1]
        # one gather for both: hidden_pre travels as fp32 beside the fp32 logits
        rows = self.fanout.gather(prepared, torch.cat([hidden.float(), base], dim=1)[: prepared.num_logits])
        return rows[:, :d].to(hidden.dtype), rows[:, d:]

    @torch.inference_mode()
    def follow(self) -> int:
        """A follower's loop: run every step the driver publishes through `execute` (the same strategy
        forward, no sampling), and every draft block through `execute_draft`, until the driver says
        stop; returns the number of messages run."""
        steps = 0
        while (prepared := self.fanout.receive(self.strategy)) is not None:
            if prepared.fanout.kind == KIND_DRAFT:
                self.execute_draft(prepared)
            else:
                self.execute(prepared)
            steps += 1
        return steps

    def warm_up(self) -> int:
        """Build every bucket's graph now (placeholder rows only); returns the number of graphs."""
        return self.strategy.warm_up(self.cache)

    @property
    def num_graphs(self) -> int:
        return self.strategy.num_graphs
