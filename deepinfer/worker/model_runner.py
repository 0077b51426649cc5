"""ModelRunner: the one entry point of a step, for the engine and the tests alike.

    run(chunks, samples, scores) = prepare -> publish -> execute -> score -> sample

- prepare: the strategy picks a bucket, builds the host metadata (padded to the bucket when there is
  one: `prepare_host`) and moves it to the device (`to_device`), through the transport;
- publish: the transport hands the step to the other ranks of the model (nothing on one rank);
- execute: the strategy runs the forward (eager, CUDA-graph replay or Neuron region graphs), the
  real rows' logits are sliced out (padding rows always come after the real rows) and the transport
  gathers every rank's real rows back into chunk order;
- sample: the Sampler draws one token per logits row.

With the LM head split over the CP group (layers/vocab_parallel.py), a step with samples whose rows
can be served from per-rank candidates carries a HeadPlan: the ranks gather only those, and the
step's `logits` are -inf outside them (the Sampler's result is exactly that of the whole rows); any
other step gathers whole rows.

The transport (worker/step_transport.py) is the runner's only view of ranks: SingleRankTransport on
one rank, executor/step_fanout.py StepFanout on a model spread over ranks, whose followers run the
same `execute` / `execute_draft` from their receive loop (StepFanout.follow) and never sample.
A rank that runs the step without sampling passes `samples=None` and gets the logits only.

A chunk can also score known tokens (prompt logprobs): a ScoreRequest claims the first rows of
its chunk's logits rows, which then take no SampleRequest (layers/token_scores.py). Rows are
SeqChunks, so a multi-token decode row (speculative verification) is a chunk with num_new > 1 and
num_logits > 1; spec/decoder.py runs such steps without samples and verifies those rows
(spec/verify.py), sampling the other rows through `sample`; its proposer runs the draft block
through `draft` and the heads of each draft depth through `draft_heads`. A step whose sampling rows
are all greedy goes through `run_greedy_spec` instead where the strategy can (Neuron regions): the
acceptance and the next draft block run on the device after the forward (spec/greedy_step.py).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from deepinfer.model_executor.layers.token_scores import TokenScores, score_tokens
from deepinfer.model_executor.layers.vocab_parallel import head_plan
from deepinfer.model_executor.models.dspark_draft import DraftBlock
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.greedy_step import GreedySpecOutput
from deepinfer.worker.runners.base import RunnerStrategy
from deepinfer.worker.step_transport import PreparedStep, SingleRankTransport, StepTransport


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
class StepOutput:
    logits: torch.Tensor               # [num_logits, vocab] fp32, real rows in chunk order
    sampled: SamplerOutput | None      # None when the step was run without sampling
    scores: list[TokenScores] | None = None  # one per ScoreRequest, in order


@dataclass
class RunnerTiming:
    """Wall time of the phases of the latest ModelRunner.run (seconds)."""
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


def _plain_argmax(s: SampleRequest) -> bool:
    """Whether the sampler's token for `s` is its row's raw argmax and all it reports: greedy, no ban,
    grammar mask, logit bias, penalty or logprobs."""
    return s.params.greedy_raw_argmax and s.params.logprobs is None and not s.banned_ids and s.bitmask is None


class ModelRunner:
    def __init__(self, model, cache, layout, strategy: RunnerStrategy, sampler: Sampler | None = None,
                 transport: StepTransport | None = None):
        """transport: how steps reach the model's ranks (worker/step_transport.py); one rank by default."""
        self.model = model
        self.cache = cache
        self.layout = layout
        self.strategy = strategy
        self.sampler = sampler or Sampler()
        self.transport = transport if transport is not None else SingleRankTransport()
        self.last_timing = RunnerTiming()
        self.row_argmax = None   # the latest `execute`'s rows' argmax, where the head computed it

    def prepare(self, chunks: list[SeqChunk]) -> PreparedStep:
        return self.transport.prepare(self.strategy, chunks)

    def publish(self, prepared: PreparedStep) -> None:
        """Hand the step to the other ranks (a no-op on one rank)."""
        self.transport.publish(prepared)

    def execute(self, prepared: PreparedStep) -> torch.Tensor:
        # cleared first: a forward that computes no argmax (an eager prompt step, any other strategy)
        # must not leave an earlier step's behind
        self.strategy.row_argmax = None
        logits = self.strategy.forward(prepared.step, self.cache, prepared.bucket)[: prepared.num_logits]
        # the head's argmax holds for these rows only when they are this rank's own, in order
        ids = self.strategy.row_argmax
        self.row_argmax = ids[: prepared.num_logits] if ids is not None and self.local_rows else None
        shard = self.vocab_shard
        if shard is None:
            return self.transport.gather(prepared, logits)
        # the head's vocabulary slice: whole rows, or the CP group's candidates (layers/vocab_parallel.py)
        rows = self.transport.gather(prepared, shard.leave_group(logits, prepared.head))
        return shard.candidate_logits(rows, prepared.head)

    @property
    def local_rows(self) -> bool:
        """Whether `execute`'s logits are this rank's forward's rows (one rank: no gather, no split head)."""
        return isinstance(self.transport, SingleRankTransport) and self.vocab_shard is None

    @property
    def vocab_shard(self):
        """layers/vocab_parallel.VocabShard of a model whose LM head is split over the CP group."""
        return getattr(self.model, "vocab_shard", None)

    def sample(self, logits: torch.Tensor, samples: list[SampleRequest],
               row_argmax: torch.Tensor | None = None) -> SamplerOutput:
        """row_argmax: each logits row's argmax when known (the head's, `execute`), else None."""
        if len(samples) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows but {len(samples)} sample requests")
        if row_argmax is not None and all(map(_plain_argmax, samples)):
            # every row's token is its argmax and nothing else is asked: the head's argmax is the
            # sampler's answer (Sampler.greedy_tokens, ties to the lowest id), without building the
            # batch's per-row state (seeds, draws, bans): ~0.25 against ~0.05 ms of a batch-1 step on
            # the trained tiny V4.1 (README "Greedy verification without the sampling state")
            return SamplerOutput(token_ids=row_argmax.to(torch.int64, copy=True))
        batch = SamplingBatch.build([s.params for s in samples], [s.position for s in samples],
                                    seeds=[s.seed for s in samples],
                                    banned_ids_per_row=[s.banned_ids for s in samples], device=logits.device,
                                    output_ids_per_row=[s.output_token_ids for s in samples],
                                    prompt_ids_per_row=[s.prompt_token_ids for s in samples],
                                    bitmask_per_row=[s.bitmask for s in samples])
        return self.sampler.forward(logits, batch, row_argmax=row_argmax)

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
        if self.vocab_shard is not None and samples:
            prepared.head = head_plan([s.params for s in samples], [s.banned_ids for s in samples],
                                      scored=bool(scores))
        self.publish(prepared)
        t1 = time.perf_counter()
        logits = self.execute(prepared)
        t2 = time.perf_counter()
        scored, sample_logits = (None, logits) if not scores else self.score(logits, chunks, scores)
        row_argmax = None if scores else self.row_argmax   # scoring takes rows out
        sampled = None if samples is None else self.sample(sample_logits, samples, row_argmax)
        t3 = time.perf_counter()
        self.last_timing = RunnerTiming(t1 - t0, t2 - t1, t3 - t2)
        return StepOutput(logits, sampled, scored)

    @torch.inference_mode()
    def draft(self, block: DraftBlock, noise_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_pre [R*B, D], base logits [R*B, V] fp32) of one DSpark draft block
        (models/dspark_draft.py DraftBlock), rows in block order. On a model spread over ranks the
        block is published first and every rank runs it (its MoE and lane attention have collectives)."""
        prepared = self.transport.prepare_draft(self.strategy, block, noise_id)
        self.publish(prepared)
        return self.execute_draft(prepared)

    def execute_draft(self, prepared: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, base = self.strategy.forward_draft(prepared.step, self.cache)
        n = prepared.num_logits   # rows a strategy padded the block with come last
        return self.transport.gather_draft(prepared, hidden[:n], base[:n])

    @torch.inference_mode()
    def draft_greedy(self, block: DraftBlock, noise_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(drafts [R, B] int64, confidences [R, B] fp32) of a draft block whose rows all draft by argmax,
        its heads run with the block (one region on Neuron: no logits leave the device); None where the
        strategy drafts on the host (then `draft` and `draft_heads`). On a model over ranks every rank
        runs the block (published as such) and the group leaders' rows are gathered."""
        if not self.strategy.greedy_drafts_in_graph:
            return None
        prepared = self.transport.prepare_draft(self.strategy, block, noise_id, greedy=True)
        self.publish(prepared)
        return self.execute_draft_greedy(prepared)

    def execute_draft_greedy(self, prepared: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.strategy.forward_draft_greedy(prepared.step, self.cache)
        b = out.shape[1] // 2
        # this rank's real rows (placeholder rows come last), then every group's in block order, gathered
        # on the device; the host's one copy
        rows = self.transport.gather(prepared, out[: prepared.num_logits]).cpu()
        return rows[:, :b].long(), rows[:, b:]

    @torch.inference_mode()
    def run_greedy_spec(self, chunks: list[SeqChunk], plan) -> GreedySpecOutput | None:
        """A step whose sampling rows are all greedy (spec/greedy_step.py GreedySpecPlan), verified and
        drafted on the device in one program: one copy in, one copy back (tokens, accepted counts,
        next drafts and confidences). On a model over ranks every rank runs the program (one message);
        the group leaders' outputs are gathered. None where the strategy or the step cannot (then `run`,
        host verification, `draft_greedy` / `draft`)."""
        if not self.greedy_spec_on_device:
            return None
        t0 = time.perf_counter()
        prepared = self.transport.prepare_greedy_spec(self.strategy, chunks, plan)
        if prepared is None:
            return None
        self.publish(prepared)
        out = self.execute_greedy_spec(prepared)
        self.last_timing = RunnerTiming(0.0, time.perf_counter() - t0, 0.0)
        return GreedySpecOutput.parse(out, len(plan), plan.num_drafts)

    def execute_greedy_spec(self, prepared: PreparedStep) -> torch.Tensor:
        out = self.strategy.forward_greedy_spec(prepared.step, self.cache, prepared.bucket)
        return self.transport.gather(prepared, out).cpu()   # gathered on the device, then the one copy

    @property
    def greedy_spec_on_device(self) -> bool:
        """Whether `run_greedy_spec` can run at all (the strategy can)."""
        return self.strategy.greedy_spec_on_device

    def draft_heads(self, hidden: torch.Tensor, base: torch.Tensor,
                    prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, V], confidence [N]) of one draft depth: block rows' hidden_pre and base logits
        and the previous token of each row's draft path. The heads are replicated on every rank, so
        only the driver runs them."""
        return self.strategy.draft_heads(hidden, base, prev_ids)

    def warm_up(self) -> int:
        """Build every bucket's graph now (placeholder rows only); returns the number of graphs."""
        return self.strategy.warm_up(self.cache)

    @property
    def num_graphs(self) -> int:
        return self.strategy.num_graphs
