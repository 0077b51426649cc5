"""Speculative verification: the accept / resample rule of docs/model.md §6.4.

It lives in the spec package, beside the proposer that makes the drafts it judges, because it is the
one rule that ties the two together (which q a draft came from, which draw stream it used); the
distributions it judges under are the sampler's own (layers/sampler.py), computed by its public
functions, so a verified token and a plainly sampled one see the same processed distribution.

A request r verifies B draft tokens d_0 .. d_{B-1} with one main forward over
[x0, d_0, .., d_{B-1}]; verify row j of that forward predicts the token at position
positions[r] + j, the position d_j would take. So row j both judges d_j and, when d_j is the
first rejected draft (or j = B), supplies the token emitted there.

Per verify row, the target distribution p is the sampler's processed distribution
(sampler.py, §6.1: step a, bans, temperature, top-p, top-k, min-p), computed by the sampler's
own functions on a SamplingBatch over the R * (B + 1) verify rows.

Greedy request: accept while d_j == argmax of row j (the sampler's greedy token); the emitted
tokens are the argmaxes of rows 0 .. accepted, i.e. the accepted drafts and then the correction
(or, when all B match, the bonus token). This is plain greedy decoding, token for token.

Sampled request, with q the draft's processed distribution (draft_logprobs), per row j in order:
  1. accept d_j iff exp(min(0, log p(d_j) - log q(d_j))) > u_verify(seed, pos_j), i.e. with
     probability min(1, p/q); a token p gives no mass is never accepted;
  2. on the first rejection, emit a case-1 draw (sample_draw.CASE_RESAMPLE) at pos_j from the
     residual max(p - alpha * q, 0), alpha = DRAFT_PROB_PENALTY (the draw normalises it);
  3. when all B drafts are accepted, emit a case-0 draw from p of row B: the very token the
     plain sampler would draw at that position, so B = 0 is ordinary sampling.
Steps 1-2 make each emitted token distributed exactly as p (up to the alpha term below) when
d_j was drawn from q; tests/unit/test_spec_verify.py measures that.

alpha < 1 (upstream DeepInfer's DRAFT_PROB_PENALTY) keeps the residual nonzero when p and q agree up to
rounding and a rejection still happens; it moves at most (1 - alpha) ~ 5e-5 of mass. Pass
draft_prob_penalty=1.0 for the textbook residual.

A draft token < 0 means "no draft here" (a request verifying fewer than B): it and every later
draft are rejected, and the token emitted there is a case-0 draw from p, so a request with drafts
[d_0, -1] gets what it would with B = 1 and [d_0]. Without draft_logprobs every draft counts as
drawn deterministically (q one-hot on d_j): accept with probability p(d_j), residual = p minus
alpha at d_j, which is exact for a greedy draft under a sampled target.

Draws are keyed by (request seed, position, case) only (§6.2): the verify draw and the case-1
resample draw are streams apart from the case-0 sampling draw, and nothing depends on the batch.
The proposer samples drafts with seed + DRAFT_SEED_OFFSET (spec/proposer.py), a different stream again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer.model_executor.layers.sample_draw import (
    CASE_RESAMPLE, sample_from_probs, sample_uniforms, verify_uniforms)
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch, logprob_output
from deepinfer.sampling_params import SamplingParams

DRAFT_PROB_PENALTY = math.exp(-5e-5)  # upstream DeepInfer's alpha in max(p - alpha * q, 0)
NO_TOKEN = -1  # token_ids beyond a request's emitted tokens

_unseeded_rng = random.Random()


@dataclass
class VerifyBatch:
    """Sampling state of one verification step: R requests, B drafts each.

    Verify row r * (B + 1) + j of `sampling` is request r at depth j (position positions[r] + j).
    """

    sampling: SamplingBatch  # R * (B + 1) rows; its uniforms are the case-0 draws
    num_drafts: int  # B
    accept_uniforms: torch.Tensor  # [R, B] f64, u_verify at depth j
    resample_uniforms: torch.Tensor  # [R, B] f64, case-1 draw at depth j
    greedy: torch.Tensor  # [R] bool

    @property
    def num_requests(self) -> int:
        return self.greedy.shape[0]

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        positions: Sequence[int],
        num_drafts: int,
        seeds: Sequence[int | None] | None = None,
        banned_ids_per_row: Sequence[Sequence[int]] | None = None,
        output_ids_per_row: Sequence[Sequence[int]] | None = None,
        prompt_ids_per_row: Sequence[Sequence[int]] | None = None,
        bitmask_per_row: Sequence[torch.Tensor | None] | None = None,
        need_logprobs: bool | None = None,
        device: torch.device | str = "cpu",
        rng: random.Random | None = None,
    ) -> "VerifyBatch":
        """Request r samples with params_list[r]; positions[r] is the position of the token its
        verify row 0 produces (the first draft's position).

        seeds: None -> params.seed; a request without a seed draws one 64-bit seed from `rng`
        (default: process-wide), shared by all its depths.
        The *_per_row arguments are per verify row (R * (B + 1) entries, row r * (B + 1) + j)
        and go to SamplingBatch.build unchanged: bans (min_tokens), generated ids (which at
        depth j include d_0 .. d_{j-1}) and grammar bitmasks all depend on the depth.
        prompt_ids_per_row is per request.
        """
        n, b = len(params_list), int(num_drafts)
        if b < 0:
            raise ValueError(f"num_drafts must be >= 0 (got {num_drafts})")
        if len(positions) != n or (seeds is not None and len(seeds) != n):
            raise ValueError(f"positions and seeds need one entry per request ({n})")
        if prompt_ids_per_row is not None and len(prompt_ids_per_row) != n:
            raise ValueError(f"prompt_ids_per_row needs one entry per request ({n})")
        rng = rng or _unseeded_rng
        req_seeds = []
        for i, p in enumerate(params_list):
            s = p.seed if seeds is None else seeds[i]
            req_seeds.append(rng.getrandbits(64) if s is None else int(s))
        depth = b + 1
        row_seeds = [s for s in req_seeds for _ in range(depth)]
        row_positions = [int(pos) + j for pos in positions for j in range(depth)]
        sampling = SamplingBatch.build(
            [p for p in params_list for _ in range(depth)], row_positions, seeds=row_seeds,
            banned_ids_per_row=banned_ids_per_row, need_logprobs=need_logprobs, device=device,
            output_ids_per_row=output_ids_per_row,
            prompt_ids_per_row=(None if prompt_ids_per_row is None
                                else [ids for ids in prompt_ids_per_row for _ in range(depth)]),
            bitmask_per_row=bitmask_per_row)
        # Depths 0 .. B-1 judge a draft; depth B only ever emits.
        draft_seeds = [s for s in req_seeds for _ in range(b)]
        draft_positions = [int(pos) + j for pos in positions for j in range(b)]

        def draws(u) -> torch.Tensor:
            return torch.from_numpy(u).reshape(n, b).to(device)

        return cls(
            sampling=sampling,
            num_drafts=b,
            accept_uniforms=draws(verify_uniforms(draft_seeds, draft_positions)),
            resample_uniforms=draws(sample_uniforms(draft_seeds, draft_positions, CASE_RESAMPLE)),
            greedy=torch.tensor([p.is_greedy for p in params_list], dtype=torch.bool, device=device),
        )


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor  # [R] int64, drafts accepted (0..B); the request emits this + 1
    token_ids: torch.Tensor  # [R, B + 1] int64: accepted drafts, then the emitted token; NO_TOKEN after
    logprobs: torch.Tensor | None = None  # [R, B + 1] f32 under p (processed), -inf after; when asked
    # With logprobs: each token's 1-based rank under p and p's top-k (k = the batch's num_top_logprobs),
    # as the plain sampler reports them (sampler.logprob_output); entries after the emitted token are junk.
    token_ranks: torch.Tensor | None = None  # [R, B + 1] int64
    top_ids: torch.Tensor | None = None  # [R, B + 1, k] int64
    top_logprobs: torch.Tensor | None = None  # [R, B + 1, k] f32

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def acceptance_probability(target_lp: torch.Tensor, draft_lp: torch.Tensor) -> torch.Tensor:
    """exp(min(0, log p - log q)) in fp64, for the drafted token's log p and log q.

    p = 0 gives 0 (never accepted, also when q = 0: the nan of -inf - -inf becomes 0).
    """
    ratio = torch.exp(torch.clamp(target_lp.double() - draft_lp.double(), max=0.0))
    return torch.nan_to_num(ratio, nan=0.0)


def residual(p: torch.Tensor, q: torch.Tensor, alpha: float) -> torch.Tensor:
    """The unnormalised distribution a rejection resamples from: max(p - alpha * q, 0)."""
    return torch.clamp(p - alpha * q, min=0.0)


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """[N, B] bool -> [N] count of leading Trues."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.int64, device=ok.device)
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)


def _check_shapes(target_logits, draft_tokens, draft_logprobs, batch: VerifyBatch) -> None:
    r, b = batch.num_requests, batch.num_drafts
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (r, b + 1):
        raise ValueError(f"target_logits must be [{r}, {b + 1}, V] (got {tuple(target_logits.shape)})")
    vocab = target_logits.shape[2]
    if tuple(draft_tokens.shape) != (r, b):
        raise ValueError(f"draft_tokens must be [{r}, {b}] (got {tuple(draft_tokens.shape)})")
    if draft_tokens.numel() and int(draft_tokens.max()) >= vocab:
        raise ValueError(f"draft token ids must be < vocab size {vocab}")
    if draft_logprobs is not None and tuple(draft_logprobs.shape) != (r, b, vocab):
        raise ValueError(f"draft_logprobs must be [{r}, {b}, {vocab}] (got {tuple(draft_logprobs.shape)})")


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logprobs: torch.Tensor | None,
    batch: VerifyBatch,
    sampler: Sampler | None = None,
    draft_prob_penalty: float = DRAFT_PROB_PENALTY,
    row_argmax: torch.Tensor | None = None,
) -> VerifyOutput:
    """Judge each request's drafts (module docstring); all requests at once.

    target_logits [R, B+1, V]: the main model's logits at the verify rows (raw; the sampler's
    transforms are applied here). draft_tokens [R, B] int64 (< 0: no draft). draft_logprobs
    [R, B, V]: the draft's processed log-distribution each d_j was drawn from, or None (one-hot q).
    Greedy requests read neither draft_logprobs nor any draw. row_argmax [R * (B+1)]: each target row's
    argmax when the LM head computed it (Sampler.greedy_tokens), else None.
    """
    _check_shapes(target_logits, draft_tokens, draft_logprobs, batch)
    sampler = sampler or Sampler()
    r, b = batch.num_requests, batch.num_drafts
    depth, vocab = b + 1, target_logits.shape[2]
    sb = batch.sampling
    dev = target_logits.device
    drafts = draft_tokens.to(device=dev, dtype=torch.int64)
    flat = target_logits.reshape(r * depth, vocab)
    adjusted = Sampler.adjusted_logits(flat, sb)
    if adjusted is not flat:   # penalties, biases or a grammar changed the rows
        row_argmax = None
    num_accepted = torch.zeros(r, dtype=torch.int64, device=dev)
    token_ids = torch.full((r, depth), NO_TOKEN, dtype=torch.int64, device=dev)
    logprobs_all = sampler.adjusted_logprobs(adjusted, sb) if sb.need_logprobs else None

    greedy_req = batch.greedy.nonzero().squeeze(1)
    if greedy_req.numel():
        # sb.greedy_rows are exactly these requests' verify rows, in the same order.
        top = sampler.greedy_tokens(adjusted, sb, row_argmax).reshape(-1, depth)
        acc = accepted_prefix(top[:, :b] == drafts.index_select(0, greedy_req))
        keep = torch.arange(depth, device=dev).unsqueeze(0) <= acc.unsqueeze(1)
        num_accepted.index_copy_(0, greedy_req, acc)
        token_ids.index_copy_(0, greedy_req, top.masked_fill(~keep, NO_TOKEN))

    sampled_req = (~batch.greedy).nonzero().squeeze(1)
    if sampled_req.numel():
        if logprobs_all is not None:
            lp = logprobs_all.index_select(0, sb.random_rows)
        else:
            lp = sampler.adjusted_logprobs(adjusted, sb, sb.random_rows)
        lp = lp.reshape(-1, depth, vocab)
        acc, emitted = _verify_sampled(
            lp, drafts.index_select(0, sampled_req),
            None if draft_logprobs is None else draft_logprobs.to(dev).index_select(0, sampled_req),
            batch.accept_uniforms.index_select(0, sampled_req),
            batch.resample_uniforms.index_select(0, sampled_req),
            sb.uniforms.reshape(r, depth).index_select(0, sampled_req),
            draft_prob_penalty, sparse=sb.any_filter)
        num_accepted.index_copy_(0, sampled_req, acc)
        token_ids.index_copy_(0, sampled_req, emitted)

    out = VerifyOutput(num_accepted=num_accepted, token_ids=token_ids)
    if logprobs_all is not None:
        lo = logprob_output(logprobs_all, token_ids.clamp(min=0).reshape(-1), sb.num_top_logprobs)
        out.logprobs = lo.logprobs.reshape(r, depth).masked_fill(token_ids < 0, float("-inf"))
        out.token_ranks = lo.token_ranks.reshape(r, depth)
        if lo.top_ids is not None:
            out.top_ids = lo.top_ids.reshape(r, depth, -1)
            out.top_logprobs = lo.top_logprobs.reshape(r, depth, -1)
    return out


def _verify_sampled(lp, drafts, draft_lp, accept_u, resample_u, sample_u, alpha, sparse):
    """Sampled requests: lp [S, B+1, V] target logprobs; returns (accepted [S], tokens [S, B+1])."""
    s, depth, vocab = lp.shape
    b = depth - 1
    dev = lp.device
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    target_at_draft = lp[:, :b].gather(2, safe.unsqueeze(2)).squeeze(2)
    if draft_lp is None:
        draft_at_draft = torch.zeros_like(target_at_draft)  # log 1: q is one-hot on the draft
    else:
        draft_at_draft = draft_lp.gather(2, safe.unsqueeze(2)).squeeze(2)
    ok = (acceptance_probability(target_at_draft, draft_at_draft) > accept_u) & has_draft
    acc = accepted_prefix(ok)

    # The emitting depth k = acc: a residual draw if d_k was rejected, else (k = B, or no draft
    # at k) a fresh case-0 draw from p.
    rows = torch.arange(s, device=dev)
    p = lp[rows, acc].exp()
    k = acc.clamp(max=max(b - 1, 0))
    rejected = (acc < b) & has_draft[rows, k] if b else torch.zeros(s, dtype=torch.bool, device=dev)
    probs = p
    if bool(rejected.any()):
        rej = rejected.nonzero().squeeze(1)
        if draft_lp is None:
            q = torch.zeros(rej.numel(), vocab, dtype=p.dtype, device=dev)
            q[torch.arange(rej.numel(), device=dev), safe[rej, k[rej]]] = 1.0
        else:
            q = draft_lp[rej, k[rej]].exp().to(p.dtype)
        res = residual(p.index_select(0, rej), q, alpha)
        # A residual with no mass left (p == q to the last bit) falls back to p.
        empty = res.sum(dim=1) <= 0
        res = torch.where(empty.unsqueeze(1), p.index_select(0, rej), res)
        probs = p.clone()
        probs.index_copy_(0, rej, res)
    u = torch.where(rejected, resample_u[rows, k] if b else sample_u[:, 0], sample_u[rows, acc])
    emitted_tok = sample_from_probs(probs, u, sparse=sparse)

    ids = torch.arange(depth, device=dev).unsqueeze(0)
    tokens = torch.full((s, depth), NO_TOKEN, dtype=torch.int64, device=dev)
    tokens[:, :b] = torch.where(ids[:, :b] < acc.unsqueeze(1), drafts, NO_TOKEN)
    tokens[rows, acc] = emitted_tok
    return acc, tokens
