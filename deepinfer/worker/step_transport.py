"""How a step's inputs reach the ranks that run it, and how their logits rows come back: the one
seam between the ModelRunner (worker/model_runner.py) and a model spread over ranks.

The runner prepares, publishes and gathers every step, and every draft block, through its transport:
- SingleRankTransport (here): this rank alone runs the step; its inputs are the strategy's own,
  publishing does nothing and every logits row is already local;
- StepFanout (executor/step_fanout.py): the step shared out over the ranks of one model, published
  to the followers and its rows gathered back to the driver; it also owns the followers' receive loop
  and the wire kinds of its messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.model_executor.forward_meta import SeqChunk, StepInputs
from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
from deepinfer.model_executor.static_step import Bucket


@dataclass
class PreparedStep:
    step: StepInputs
    bucket: Bucket | None
    num_logits: int   # real logits rows (the strategy may return more: padding rows)
    fanout: object = None  # executor/step_fanout.FanoutStep: the step's share-out over ranks (None: one rank)
    # layers/vocab_parallel.HeadPlan of this rank's rows: how logits leave a vocabulary-split CP group
    # (None: whole rows); set by the runner before publish, which hands each group its rows' plan
    head: object = None


def logit_rows(chunks: list[SeqChunk]) -> int:
    """Logits rows the chunks produce (a chunk's num_logits, at most its new tokens)."""
    return sum(min(c.num_logits, c.num_new) for c in chunks)


class StepTransport(Protocol):
    def prepare(self, strategy, chunks: list[SeqChunk]) -> PreparedStep:
        """This rank's share of the step, on its device (the whole step's share-out kept for publish)."""

    def prepare_draft(self, strategy, block: DraftBlock, noise_id: int, greedy: bool = False) -> PreparedStep:
        """A DSpark draft block (models/dspark_draft.py) as a step: B rows per sequence (greedy: the
        heads run with the block, one row of drafts and confidences a sequence)."""

    def prepare_greedy_spec(self, strategy, chunks: list[SeqChunk], plan) -> PreparedStep | None:
        """A verification step whose sampling rows are all greedy, as one device program per rank
        (spec/greedy_step.py GreedySpecPlan `plan`); num_logits counts the plan's rows, which come back
        from `gather` in plan order. None where the strategy cannot (the host verifies)."""

    def publish(self, prepared: PreparedStep) -> None:
        """Hand the prepared step to every other rank that runs it."""

    def gather(self, prepared: PreparedStep, logits: torch.Tensor) -> torch.Tensor:
        """The driver: every real logits row of the step, in chunk order, from this rank's."""

    def gather_draft(self, prepared: PreparedStep, hidden: torch.Tensor,
                     base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The driver: (hidden_pre, base logits) of every block row, in block order, from this rank's."""


class SingleRankTransport:
    """The model runs on this rank alone."""

    def prepare(self, strategy, chunks: list[SeqChunk]) -> PreparedStep:
        step, bucket = strategy.prepare(chunks)
        return PreparedStep(step, bucket, logit_rows(chunks))

    def prepare_draft(self, strategy, block: DraftBlock, noise_id: int, greedy: bool = False) -> PreparedStep:
        padded = block.padded(strategy.draft_rows(len(block)))
        step = strategy.draft_to_device(draft_step_inputs(padded, strategy.layout, noise_id))
        return PreparedStep(step, None, len(block) * (1 if greedy else block.block))

    def prepare_greedy_spec(self, strategy, chunks: list[SeqChunk], plan) -> PreparedStep | None:
        got = strategy.greedy_spec_inputs(chunks, len(plan))
        if got is None:
            return None
        step, bucket, rows = got
        return PreparedStep(strategy.greedy_spec_to_device(step, bucket, plan.meta(rows)), bucket, len(plan))

    def publish(self, prepared: PreparedStep) -> None:
        pass

    def gather(self, prepared: PreparedStep, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def gather_draft(self, prepared: PreparedStep, hidden: torch.Tensor,
                     base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, base
