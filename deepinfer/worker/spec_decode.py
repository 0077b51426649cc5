"""Speculative decoding on the worker: one main forward verifies every row's drafts, then one draft
forward proposes the next drafts (docs/model.md §3.8, §6.4).

A step, for the scheduled rows (engine/scheduler.py):
1. main forward (ModelRunner.run, no sampling): a decode row with drafts d_0 .. d_{n-1} is the chunk
   [x0, d_0, .., d_{n-1}] with 1 + n logits rows; every other row is as without drafts. The forward
   also writes the draft layers' main keys (models/dspark_draft.py);
2. rows without drafts sample as usual (ModelRunner.sample); rows with drafts go through
   layers/spec_verify.verify: greedy accepts while the draft equals the argmax, sampled accepts with
   probability min(1, p/q) and resamples from the residual, every draw keyed by (seed, position);
3. every sampling row of a draft-capable sequence then drafts from the token it emitted last: one
   DSpark block of B tokens per sequence, its drafts sampled depth by depth (the Markov head needs the
   previous draft) with the request's own sampling parameters on the "mtp" stream (seed +
   MTP_SEED_OFFSET, position of the drafted token).

Which sequences draft: every sampling row, at most what its next step could emit within max_tokens
and max_model_len.
- A grammar row (structured_output.py) samples draft k under the grammar's mask after this step's
  emitted tokens and drafts d_0 .. d_{k-1}; verification judges depth j under the mask after
  d_0 .. d_{j-1}. Both come from GrammarState.masks_along, which walks the sequence's matcher along
  those uncommitted tokens and rolls it back, so the matcher moves only when the scheduler appends
  the emitted tokens (stop_rules.py), exactly as without drafts. Drafting stops where the path ends:
  after a token that completes the grammar, or before a depth where nothing may follow (a dead end).
- A logprobs row gets, for every emitted token, the logprob, rank and top-N that the plain sampler
  would report there: verification computes them from the processed target distribution of that
  depth (spec_verify.VerifyOutput, sampler.logprob_output).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer.model_executor.layers.sample_draw import MTP_SEED_OFFSET, sample_uniforms
from deepinfer.model_executor.layers.sampler import SamplingBatch
from deepinfer.model_executor.layers.spec_verify import VerifyBatch, verify
from deepinfer.model_executor.models import dspark_draft
from deepinfer.stop_rules import banned_token_ids


@dataclass
class DraftProposal:
    """A sequence's drafts for its next step (stored on the Sequence by the scheduler)."""
    token_ids: list[int]
    logprobs: torch.Tensor | None  # [n, V] the processed draft distribution q (sampled requests)
    confidences: list[float]


@dataclass
class SpecRow:
    """What one sampling row emitted: tokens as (token_id, logprob, rank, top) like _SamplerRows."""
    tokens: list[tuple]
    num_drafts: int = 0
    num_accepted: int = 0
    proposal: DraftProposal | None = None


@dataclass
class SpecStepOutput:
    rows: list[SpecRow] = field(default_factory=list)  # one per do_sample ScheduledSeq, in order


def bans_at(seq, eos_ids, ahead: int) -> tuple[int, ...]:
    """banned_token_ids for the output `ahead` tokens after the sequence's current last one."""
    if ahead == 0:
        return tuple(banned_token_ids(seq, eos_ids))
    p = seq.sampling_params
    if seq.num_output_tokens + ahead >= (getattr(p, "min_tokens", 0) or 0):
        return ()
    banned = list(getattr(p, "stop_token_ids", None) or [])
    if not getattr(p, "ignore_eos", False):
        banned += list(eos_ids)
    return tuple(banned)


class SpecDecoder:
    def __init__(self, runner, model, num_drafts: int, max_model_len: int, eos_ids):
        self.runner = runner
        self.model = model
        self.num_drafts = int(num_drafts)
        self.max_model_len = int(max_model_len)
        self.eos_ids = list(eos_ids)
        self.noise_id = int(model.cfg.dspark_noise_token_id)

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, worker, scheduled, chunks, scores):
        """(SpecStepOutput, the ScoreRequests' results) of one step of `scheduled` (as `chunks`)."""
        out = self.runner.run(chunks, None, scores or None)
        logits = out.logits
        plain, spec = [], []  # (scheduled index, first sampling row)
        row = 0
        for i, (s, c) in enumerate(zip(scheduled, chunks)):
            n_rows = min(c.num_logits, c.num_new)
            if s.do_sample:
                first = row + n_rows - (1 + len(s.draft_ids))
                (spec if s.draft_ids else plain).append((i, first))
            row += n_rows
        results: dict[int, SpecRow] = {}
        if plain:
            idx = torch.tensor([r for _, r in plain], dtype=torch.long, device=logits.device)
            sampled = self.runner.sample(logits.index_select(0, idx),
                                         [worker._sample_request(scheduled[i].seq) for i, _ in plain])
            for j, (i, _) in enumerate(plain):
                results[i] = SpecRow([_row(sampled, j)])
        if spec:
            results.update(self._verify(scheduled, spec, logits))
        self._draft(scheduled, results)
        return SpecStepOutput([results[i] for i, s in enumerate(scheduled) if s.do_sample]), out.scores

    def _verify(self, scheduled, spec, logits) -> dict[int, SpecRow]:
        bmax = max(len(scheduled[i].draft_ids) for i, _ in spec)
        vocab = logits.shape[1]
        seqs = [scheduled[i].seq for i, _ in spec]
        target = torch.empty(len(spec), bmax + 1, vocab, dtype=logits.dtype, device=logits.device)
        drafts = torch.full((len(spec), bmax), -1, dtype=torch.long)
        q = None
        bans, outs, masks = [], [], []
        for r, (i, first) in enumerate(spec):
            s = scheduled[i]
            n = len(s.draft_ids)
            target[r, :n + 1] = logits[first:first + n + 1]
            target[r, n + 1:] = logits[first + n]  # unused depths (no draft there)
            drafts[r, :n] = torch.tensor(s.draft_ids, dtype=torch.long)
            lp = s.seq.draft_logprobs
            if lp is not None:
                if q is None:
                    q = torch.zeros(len(spec), bmax, vocab, dtype=torch.float32, device=logits.device)
                q[r, :n] = lp[:n].to(q.device)
            sp = s.seq.sampling_params
            penalised = sp.penalises_output or sp.penalises_repetition  # only those rows read outputs
            for j in range(bmax + 1):
                bans.append(bans_at(s.seq, self.eos_ids, j))
                outs.append(s.seq.output_token_ids + list(s.draft_ids[:j]) if penalised else ())
            masks += _grammar_masks(s.seq, self.eos_ids, list(s.draft_ids), 0, bmax + 1)
        batch = VerifyBatch.build([x.sampling_params for x in seqs], [len(x) for x in seqs], bmax,
                                  seeds=[x.seed for x in seqs], banned_ids_per_row=bans,
                                  output_ids_per_row=outs,
                                  prompt_ids_per_row=[x.prompt_token_ids for x in seqs],
                                  bitmask_per_row=masks, device=logits.device)
        res = verify(target, drafts.to(logits.device), q, batch, self.runner.sampler)
        acc, tokens = res.num_accepted.tolist(), res.token_ids.tolist()
        found = {}
        for r, (i, _) in enumerate(spec):
            if res.logprobs is None:
                emitted = [(t, None, None, []) for t in tokens[r][:acc[r] + 1]]
            else:
                emitted = [_row(res, r, j) for j in range(acc[r] + 1)]
            found[i] = SpecRow(emitted, num_drafts=len(scheduled[i].draft_ids), num_accepted=acc[r])
        return found

    def _draft(self, scheduled, results: dict[int, SpecRow]) -> None:
        """Propose the next drafts of every sampling row that can use them."""
        rows = []
        for i, s in enumerate(scheduled):
            if not s.do_sample:
                continue
            seq, emitted = s.seq, len(results[i].tokens)
            new_len = len(seq) + emitted  # length once the scheduler has appended the tokens
            p = seq.sampling_params
            room = self.max_model_len - new_len
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - (seq.num_output_tokens + emitted) - 1)
            n = min(self.num_drafts, room)
            if n >= 1:
                rows.append((i, n, new_len))
        if not rows:
            return
        b = self.num_drafts
        block = dspark_draft.DraftBlock(
            slots=[scheduled[i].seq.state_slot for i, _, _ in rows],
            last_pos=[new_len - 2 for _, _, new_len in rows],
            first_tokens=[results[i].tokens[-1][0] for i, _, _ in rows], block=b)
        runner = self.runner
        hidden, base = runner.draft(block, self.noise_id)   # every rank runs it on a model over ranks
        r = len(rows)
        hidden, base = hidden.view(r, b, -1), base.view(r, b, -1)
        seqs = [scheduled[i].seq for i, _, _ in rows]
        sampled_rows = [k for k, x in enumerate(seqs) if not x.sampling_params.is_greedy]
        prev = torch.tensor(block.first_tokens, dtype=torch.long, device=base.device)
        toks, confs = [], []
        q = torch.empty(len(sampled_rows), b, base.shape[-1]) if sampled_rows else None
        sampler = runner.sampler
        # this step's emitted tokens: outputs before the drafts (penalties, min_tokens bans)
        extra = [[t[0] for t in results[i].tokens] for i, _, _ in rows]
        limit = [n for _, n, _ in rows]  # a grammar row drafts no further than its path goes
        depth_batches = _DraftBatches(seqs, [nl for _, _, nl in rows], extra, self.eos_ids, b)
        for k in range(b):
            masks = [None] * r  # the grammar's mask after this step's tokens and the drafts so far
            for c, (x, e) in enumerate(zip(seqs, extra)):
                if x.grammar is None or k >= limit[c]:
                    continue
                path = e + [int(t[c]) for t in toks]
                masks[c] = _grammar_masks(x, self.eos_ids, path, len(path), 1)[0]
                if masks[c] is None:
                    limit[c] = k
            pe = dspark_draft.markov_embed(self.model, prev)
            lg = base[:, k] + dspark_draft.markov_logits(self.model, pe)
            confs.append(dspark_draft.confidence(self.model, hidden[:, k], pe))
            # draft k is the token at position a + 2 + k = new_len + k
            out = sampler(lg, depth_batches.at(k, toks, lg.device, masks), keep_random_logprobs=bool(sampled_rows))
            if sampled_rows:  # the processed distribution the draws came from (random rows, in order)
                q[:, k] = out.random_logprobs.cpu()
            toks.append(out.token_ids.tolist())
            prev = out.token_ids
        for c, (i, _, _) in enumerate(rows):
            n = limit[c]
            if n == 0:
                continue
            lp = None
            if not seqs[c].sampling_params.is_greedy:
                lp = q[sampled_rows.index(c), :n]
            results[i].proposal = DraftProposal([toks[k][c] for k in range(n)], lp,
                                                [float(confs[k][c]) for k in range(n)])


def _grammar_masks(seq, eos_ids, path: list[int], first: int, count: int) -> list:
    """Grammar bitmasks of the outputs `first` .. `first + count - 1` tokens after seq's last one, along
    the uncommitted tokens `path` (GrammarState.masks_along); None where the path cannot reach, and
    all None without a grammar."""
    if seq.grammar is None:
        return [None] * count
    masks = seq.grammar.masks_along(path[:first + count - 1], lambda j: bans_at(seq, eos_ids, j), first)
    return masks + [None] * (count - len(masks))


class _DraftBatches:
    """The SamplingBatch of each draft depth. Depth k differs from depth 0 only in its draw positions
    (new_len + k), min_tokens bans (bans_at) and the outputs penalties read (earlier drafts appended);
    when no row has a penalty and no row's bans change with k, depth 0's batch is reused with the
    depth's draws, instead of rebuilding every per-row tensor each depth."""

    def __init__(self, seqs, new_lens, extra, eos_ids, num_depths: int):
        self.seqs, self.new_lens, self.extra = seqs, new_lens, extra
        self.bans = [[bans_at(x, eos_ids, len(e) + k) for x, e in zip(seqs, extra)] for k in range(num_depths)]
        self.penalised = [x.sampling_params.penalises_output or x.sampling_params.penalises_repetition
                          for x in seqs]
        # grammar rows have a mask per depth (GrammarState.masks_along): their batches are rebuilt
        self.static = (not any(self.penalised) and all(bk == self.bans[0] for bk in self.bans)
                       and all(x.grammar is None for x in seqs))
        self.seeds = [x.seed + MTP_SEED_OFFSET for x in seqs]
        self.first = None

    def at(self, k: int, toks: list[list[int]], device, masks=None) -> SamplingBatch:
        positions = [nl + k for nl in self.new_lens]
        if self.static and self.first is not None:
            u = sample_uniforms(self.seeds, positions)
            return dataclasses.replace(self.first, uniforms=torch.from_numpy(u).to(device))
        seqs = self.seqs
        batch = SamplingBatch.build(
            [x.sampling_params for x in seqs], positions, seeds=self.seeds, banned_ids_per_row=self.bans[k],
            # only penalised rows read their outputs: no copy of the others' output lists
            output_ids_per_row=[x.output_token_ids + e + [int(t[c]) for t in toks] if pen else ()
                                for c, (x, e, pen) in enumerate(zip(seqs, self.extra, self.penalised))],
            prompt_ids_per_row=[x.prompt_token_ids for x in seqs], bitmask_per_row=masks,
            need_logprobs=False, device=device)
        if k == 0:
            self.first = batch
        return batch


def _row(sampled, *at) -> tuple:
    """(token_id, logprob, rank, top) at row `at` of a SamplerOutput, or (request, depth) of a
    spec_verify.VerifyOutput."""
    lp = None if sampled.logprobs is None else float(sampled.logprobs[at])
    rank = None if sampled.token_ranks is None else int(sampled.token_ranks[at])
    top = []
    if sampled.top_ids is not None and sampled.top_logprobs is not None:
        top = list(zip(sampled.top_ids[at].tolist(), sampled.top_logprobs[at].tolist()))
    return int(sampled.token_ids[at]), lp, rank, top
