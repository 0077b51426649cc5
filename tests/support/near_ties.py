"""Comparing two runs whose fp32 rounding legitimately differs (another GEMM shape or row count, another
CPU's kernels): a discrete decision -- the experts a token routes to, the entries an indexer keeps, a
sampled token -- flips where the reference decided by a hair, and everything after the flip differs by
far more than rounding. Comparing such runs bit for bit fails on some x86 CPUs and not on others.

The rule here: the other run's decision may differ from the reference's only where the reference's
margin (how far its decision was from going the other way) is below a stated threshold; such a
decision is excused and the other run is made to take the reference's decision, so everything after
it is still compared at the caller's full tolerance. A flip at a wider margin fails (a real
difference), and so do more than `max_excused` excuses (near-ties should be rare).

Ties themselves break one way in every path (the lowest index: layers/moe.py, layers/indexer.py,
layers/sampler.py), so an exact tie never needs an excuse.

- `selections_replayed`: the model's own selections (MoE top-k routing, the indexer's top-k entries),
  recorded in one reference run of one sequence and replayed in other runs of the same sequence fed in
  other chunkings; margin = (k-th - (k+1)-th score) / the row's largest |score|.
- `sampled_tokens_replayed`: the tokens of the engine's sampler, step by step between two engines
  that schedule the same requests alike; margin = the smallest drop of the reference token's logit at
  which the production sampler picks another token (greedy: the top-2 logit gap; sampled: how near the
  row's uniform draw lies to either end of the token's CDF interval, in logit units).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from deepinfer.model_executor.models import v4_attention, v4_ffn


@dataclass
class NearTies:
    """The excused flips of one comparison: `threshold` in the margin's units, at most `max_excused`."""

    what: str
    threshold: float
    max_excused: int = 2
    excused: list[tuple[str, float]] = field(default_factory=list)

    def excuse(self, where: str, margin: float) -> None:
        if not margin < self.threshold:
            raise AssertionError(f"{self.what} differs at {where}, where the reference decided by a margin of "
                                 f"{margin:.3g} (a near-tie is < {self.threshold:g}): not a rounding flip")
        self.excused.append((where, margin))
        if len(self.excused) > self.max_excused:
            raise AssertionError(f"{self.what}: {len(self.excused)} near-tie flips, more than {self.max_excused}: "
                                 f"{self.excused}")


# -- the model's selections -------------------------------------------------------------------------

def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: (k-th largest - (k+1)-th largest) / max |score| over the finite scores; inf when fewer
    than k + 1 finite scores (nothing was left out)."""
    s = torch.sort(scores.float(), dim=-1, descending=True).values
    if s.shape[-1] <= k:
        return torch.full(s.shape[:1], float("inf"))
    finite = torch.isfinite(s)
    scale = torch.where(finite, s.abs(), torch.zeros_like(s)).amax(-1).clamp_min(1e-30)
    gap = (s[:, k - 1] - s[:, k]) / scale
    return torch.where(finite[:, k], gap, torch.full_like(gap, float("inf")))


class _Selections:
    """The reference's selections by (decision number within a forward, token position)."""

    def __init__(self, model, ties: NearTies | None):
        self.ties, self.reference = ties, {}
        self.calls, self.position, self.rows = 0, 0, 0
        self.hooks = [model.register_forward_pre_hook(self._forward_starts),
                      model.register_forward_hook(self._forward_ends)]

    def _forward_starts(self, module, args):
        self.calls, self.rows = 0, 0

    def _forward_ends(self, module, args, out):
        self.position += self.rows

    def decide(self, kind: str, picked: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
        """picked [T, k] (-1: none); returns the rows to use: the reference's, where a near-tie flipped."""
        j, t = self.calls, picked.shape[0]
        self.calls, self.rows = j + 1, t
        out = picked.clone()
        for r in range(t):
            key = (j, self.position + r)
            if self.ties is None:
                self.reference[key] = (picked[r].clone(), float(margins[r]))
                continue
            ref, margin = self.reference[key]
            if set(ref[ref >= 0].tolist()) == set(picked[r][picked[r] >= 0].tolist()):
                continue
            self.ties.excuse(f"{kind} decision {j} of the forward, position {key[1]}", margin)
            valid = ref[ref >= 0]
            if valid.numel() > out.shape[1]:
                raise AssertionError(f"{kind} at position {key[1]}: the reference kept more than this run can")
            out[r] = torch.cat([valid, valid.new_full((out.shape[1] - valid.numel(),), -1)])
        return out


@contextlib.contextmanager
def selections_replayed(monkeypatch, model, reference: dict | None = None, ties: NearTies | None = None):
    """Record (reference None) or replay `model`'s routing and indexer selections over one run of one
    sequence from position 0 (tests/support/model_helpers.run_chunks: an indexer score column is the
    entry's index). Yields the recording: pass it as `reference` with `ties` to replay."""
    log = _Selections(model, ties)
    if reference is not None:
        log.reference = reference
    real_route, real_topk = v4_ffn.route, v4_attention.stable_topk

    def route(x, gate_w, bias, topk, scaling, hashed_ids=None):
        if hashed_ids is not None:
            return real_route(x, gate_w, bias, topk, scaling, hashed_ids)
        idx, _ = real_route(x, gate_w, bias, topk, scaling)
        sel = torch.sqrt(torch.nn.functional.softplus(x.float() @ gate_w.float().t()))
        sel = sel + bias.float() if bias is not None else sel
        idx = log.decide("MoE routing", idx, topk_margin(sel, topk))
        return real_route(x, gate_w, bias, topk, scaling, idx)   # weights from this run's own scores

    def stable_topk(scores, k):
        return log.decide("indexer top-k", real_topk(scores, k), topk_margin(scores, min(k, scores.shape[1])))

    with monkeypatch.context() as m:
        m.setattr(v4_ffn, "route", route)
        m.setattr(v4_attention, "stable_topk", stable_topk)
        try:
            yield log.reference
        finally:
            for hook in log.hooks:
                hook.remove()


# -- the engine's sampled tokens --------------------------------------------------------------------

def flip_margin(sampler, logits: torch.Tensor, batch, tokens: torch.Tensor, row: int, limit: float) -> float:
    """Smallest drop (on a ladder of factors of 2 up to `limit`) of the logit of tokens[row] at which the
    sampler, given the same batch (the same uniform draws), picks another token in that row; inf when
    none up to `limit` does."""
    drops = [limit / 2 ** i for i in range(16, -1, -1)]
    for drop in drops:
        moved = logits.clone()
        moved[row, tokens[row]] -= drop
        if int(sampler.forward(moved, batch).token_ids[row]) != int(tokens[row]):
            return drop
    return float("inf")


class _StepSampler:
    """The runner's sampler, recording each step's logits, batch and tokens (reference) or making this
    run's tokens the reference's where the reference's token was a near-tie (replay)."""

    def __init__(self, sampler, reference: list | None, ties: NearTies | None):
        self.sampler, self.reference, self.ties = sampler, reference, ties
        self.steps: list = []

    def forward(self, logits, batch, *args, **kw):
        out = self.sampler.forward(logits, batch, *args, **kw)
        step = len(self.steps)
        self.steps.append((logits.detach().clone(), batch, out.token_ids.clone()))
        if self.reference is None:
            return out
        ref_logits, ref_batch, ref_tokens = self.reference[step]
        if ref_tokens.shape != out.token_ids.shape:
            raise AssertionError(f"step {step}: {out.token_ids.numel()} sampled rows, the reference had "
                                 f"{ref_tokens.numel()}: the two engines did not schedule alike")
        for row in (out.token_ids != ref_tokens).nonzero().flatten().tolist():
            margin = flip_margin(self.sampler, ref_logits, ref_batch, ref_tokens, row, self.ties.threshold)
            self.ties.excuse(f"step {step} row {row} ({int(out.token_ids[row])} for {int(ref_tokens[row])})",
                             margin)
            out.token_ids[row] = ref_tokens[row]
        return out

    __call__ = forward

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def sampled_tokens_replayed(runner, reference: list | None = None, ties: NearTies | None = None) -> list:
    """Wrap `runner`'s sampler (a ModelRunner): record its steps, or replay `reference` (the steps of a
    recorded run) with `ties`. Returns the list this run's steps are recorded into."""
    wrapped = _StepSampler(runner.sampler, reference, ties)
    runner.sampler = wrapped
    return wrapped.steps
