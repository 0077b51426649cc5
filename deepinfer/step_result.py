"""What a step hands back to the scheduler: one StepResult, whether the step verified drafts or not.

The worker (worker/worker.py) returns it for a plain step, the speculative step (spec/decoder.py)
for a step with drafts; the scheduler (engine/scheduler.py `update`) reads only this type. A row is
one sampling row of the step (a ScheduledSeq with do_sample, in order): the tokens it emitted (one
for a plain row, accepted drafts + 1 for a row that verified drafts) and the drafts proposed for its
next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# (token_id, logprob or None, rank or None, [(top_id, top_logprob)]): one emitted token
EmittedToken = tuple


@dataclass
class DraftProposal:
    """A sequence's drafts for its next step (stored on the Sequence by the scheduler)."""
    token_ids: list[int]
    logprobs: object | None  # torch [n, V]: the processed draft distribution q (sampled requests)
    confidences: list[float]


@dataclass
class RowResult:
    tokens: list[EmittedToken]
    num_drafts: int = 0      # drafts the row verified
    num_accepted: int = 0    # of them accepted (the row emitted num_accepted + 1 tokens, before stops)
    proposal: DraftProposal | None = None


@dataclass
class StepResult:
    rows: list[RowResult] = field(default_factory=list)  # one per do_sample ScheduledSeq, in order


def sampled_rows(out) -> list[RowResult]:
    """One single-token row per row of a sampler's output (layers/sampler.py SamplerOutput: token_ids
    [N]; logprobs [N], token_ranks [N], top_ids / top_logprobs [N, k] or None; tensors or lists)."""
    if out is None:
        return []
    token_ids = _to_list(out.token_ids)
    logprobs, ranks = _to_list(out.logprobs), _to_list(out.token_ranks)
    top_ids, top_lps = _to_list(out.top_ids), _to_list(out.top_logprobs)
    rows = []
    for i, t in enumerate(token_ids):
        top = list(zip(top_ids[i], top_lps[i])) if top_ids is not None and top_lps is not None else []
        rows.append(RowResult([(int(t), None if logprobs is None else logprobs[i],
                                None if ranks is None else ranks[i], top)]))
    return rows


def _to_list(x):
    if x is None:
        return None
    return x.tolist() if hasattr(x, "tolist") else list(x)
