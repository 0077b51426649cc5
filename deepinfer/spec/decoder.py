"""The speculative step on the driver: one main forward verifies every row's drafts, then one draft
block proposes the next drafts (docs/model.md §3.8, §6.4).

For the scheduled rows (engine/scheduler.py; the worker, worker/worker.py, built their chunks):
1. main forward (ModelRunner.run, no sampling): a decode row with drafts d_0 .. d_{n-1} is the chunk
   [x0, d_0, .., d_{n-1}] with 1 + n logits rows; every other row is as without drafts. The forward
   also writes the draft layers' main keys (models/dspark_draft.py);
2. rows without drafts sample as usual (ModelRunner.sample, with the worker's SampleRequests); rows
   with drafts go through spec/verify.py: greedy accepts while the draft equals the argmax, sampled
   accepts with probability min(1, p/q) and resamples from the residual, every draw keyed by
   (seed, position). Depth j is judged under the bans (stop_rules.banned_token_ids `ahead` j) and
   grammar mask it would have as the j-th next output. When every row with drafts is greedy with plain
   argmaxes at the depths it verifies (no bans, grammar, bias, penalty or logprobs there), the greedy
   rule reads the head's argmax (or one argmax scan of those rows) in plain Python instead
   (`_verify_argmax`: the same tokens, without the per-depth sampling state);
3. every sampling row then gets its next drafts (spec/proposer.py).

When every sampling row is greedy with plain argmaxes (spec/greedy_step.py on_device_step), the
proposer takes device drafts (DraftProposer.drafts_on_device; oracle drafts do not) and the runner
can (ModelRunner.run_greedy_spec: region steps in a verification bucket, one rank: the Neuron
strategy and the compiled CPU one built on it), steps 1-3 run on the device as one program instead,
and only the tokens, accepted counts and next drafts come back; the tokens are the same (the
argmaxes, ties to the lowest id). Other steps, and every step of the eager and CUDA-graph
strategies, verify on the host as above.

A logprobs row gets, for every emitted token, the logprob, rank and top-N that the plain sampler
would report there: verification computes them from the processed target distribution of that
depth (verify.VerifyOutput, sampler.logprob_output).
"""
from __future__ import annotations

import torch

from deepinfer.model_executor.layers.row_argmax import first_argmax
from deepinfer.spec.greedy_step import GreedySpecPlan, on_device_step
from deepinfer.spec.proposer import DraftProposer, argmax_drafts, depth_bans, grammar_masks
from deepinfer.spec.verify import VerifyBatch, verify
from deepinfer.step_result import RowResult, StepResult, sampled_rows


class SpecDecoder:
    def __init__(self, runner, num_drafts: int, max_model_len: int, eos_ids, noise_id: int):
        """runner: the driver's ModelRunner (worker/model_runner.py)."""
        self.runner = runner
        self.eos_ids = list(eos_ids)
        self.proposer = DraftProposer(runner, num_drafts, max_model_len, eos_ids, noise_id)

    @torch.inference_mode()
    def execute(self, scheduled, chunks, plain_samples, scores):
        """(StepResult, the ScoreRequests' results) of one step of `scheduled` (as `chunks`).
        plain_samples: the SampleRequest of each sampling row without drafts, in order."""
        num_drafts = self.proposer.num_drafts
        if (self.proposer.drafts_on_device and self.runner.greedy_spec_on_device
                and on_device_step(scheduled, self.eos_ids, num_drafts, scores)):
            done = self._on_device(scheduled, chunks)
            if done is not None:
                return done, None
        out = self.runner.run(chunks, None, scores or None)
        logits = out.logits
        row_argmax = self.runner.row_argmax   # the head's argmax of these rows, or None (ModelRunner.execute)
        plain, spec = [], []  # (scheduled index, first sampling row)
        row = 0
        for i, (s, c) in enumerate(zip(scheduled, chunks)):
            n_rows = min(c.num_logits, c.num_new)
            if s.do_sample:
                first = row + n_rows - (1 + len(s.draft_token_ids))
                (spec if s.draft_token_ids else plain).append((i, first))
            row += n_rows
        if len(plain) != len(plain_samples):
            raise ValueError(f"{len(plain)} sampling rows without drafts but {len(plain_samples)} sample requests")
        results: dict[int, RowResult] = {}
        if plain:
            idx = torch.tensor([r for _, r in plain], dtype=torch.long, device=logits.device)
            ids = None if row_argmax is None else row_argmax.index_select(0, idx)
            sampled = self.runner.sample(logits.index_select(0, idx), plain_samples, ids)
            results.update(zip((i for i, _ in plain), sampled_rows(sampled)))
        if spec:
            results.update(self._verify_argmax(scheduled, spec, logits, row_argmax)
                           or self._verify(scheduled, spec, logits, row_argmax))
        self.proposer.propose(scheduled, results)
        return StepResult([results[i] for i, s in enumerate(scheduled) if s.do_sample]), out.scores

    def _on_device(self, scheduled, chunks) -> StepResult | None:
        """Every sampling row greedy (greedy_step.on_device_step): verification, acceptance and the next
        draft block in one device program where the runner can (ModelRunner.run_greedy_spec), else None.
        A row without drafts is a verification of none: its token is its row's argmax."""
        plan = GreedySpecPlan.build(scheduled, chunks, self.proposer.num_drafts)
        got = self.runner.run_greedy_spec(chunks, plan)
        if got is None:
            return None
        results = {i: RowResult([(t, None, None, []) for t in got.tokens[r]], num_drafts=len(plan.drafts[r]),
                                num_accepted=got.accepted[r]) for r, i in enumerate(plan.index)}
        self.proposer.take_drafts(scheduled, results,
                                  {i: (got.drafts[r], got.confidences[r]) for r, i in enumerate(plan.index)})
        return StepResult([results[i] for i, s in enumerate(scheduled) if s.do_sample])

    def _verify_argmax(self, scheduled, spec, logits, row_argmax=None) -> dict[int, RowResult] | None:
        """The rows' results when every row with drafts is greedy with plain argmaxes at each depth it
        verifies and asks for no logprobs (proposer.argmax_drafts, as greedy_step.on_device_step asks of
        the device program), else None (then `_verify`). Such a row's tokens are the argmaxes of its
        verification rows, ties to the lowest id, and it accepts while they equal its drafts: spec/verify.py's
        greedy rule, read from the head's argmax where it computed one (else one first_argmax over those
        rows) in plain Python, without the sampling state `_verify` builds for every depth: with oracle
        drafts at batch 1 on the trained tiny V4.1 the host's part of a ~13 ms verification step after
        its forward fell from ~1.35 to ~0.5 ms (README "Greedy verification without the sampling state")."""
        drafts = [list(scheduled[i].draft_token_ids) for i, _ in spec]
        for (i, _), d in zip(spec, drafts):
            seq = scheduled[i].seq
            if seq.sampling_params.logprobs is not None or not argmax_drafts(seq, self.eos_ids, 0, len(d) + 1):
                return None
        rows = [first + j for (_, first), d in zip(spec, drafts) for j in range(len(d) + 1)]
        if row_argmax is not None:
            every = row_argmax.tolist()
            top = [every[r] for r in rows]
        else:
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            top = first_argmax(logits.index_select(0, idx).float().contiguous()).tolist()
        found, k = {}, 0
        for (i, _), d in zip(spec, drafts):
            ids = top[k:k + len(d) + 1]
            k += len(d) + 1
            acc = 0
            while acc < len(d) and d[acc] == ids[acc]:
                acc += 1
            found[i] = RowResult([(t, None, None, []) for t in ids[:acc + 1]], num_drafts=len(d), num_accepted=acc)
        return found

    def _verify(self, scheduled, spec, logits, row_argmax=None) -> dict[int, RowResult]:
        bmax = max(len(scheduled[i].draft_token_ids) for i, _ in spec)
        vocab = logits.shape[1]
        seqs = [scheduled[i].seq for i, _ in spec]
        target = _target_view(logits, spec, [len(scheduled[i].draft_token_ids) for i, _ in spec], bmax)
        copy_rows = target is None
        if copy_rows:
            target = torch.empty(len(spec), bmax + 1, vocab, dtype=logits.dtype, device=logits.device)
        drafts = torch.full((len(spec), bmax), -1, dtype=torch.long)
        q = None
        bans, outs, masks = [], [], []
        for r, (i, first) in enumerate(spec):
            s = scheduled[i]
            n = len(s.draft_token_ids)
            if copy_rows:
                target[r, :n + 1] = logits[first:first + n + 1]
                target[r, n + 1:] = logits[first + n]  # unused depths (no draft there)
            drafts[r, :n] = torch.tensor(s.draft_token_ids, dtype=torch.long)
            lp = s.seq.draft_logprobs
            if lp is not None:
                if q is None:
                    q = torch.zeros(len(spec), bmax, vocab, dtype=torch.float32, device=logits.device)
                q[r, :n] = lp[:n].to(q.device)
            sp = s.seq.sampling_params
            penalised = sp.penalises_output or sp.penalises_repetition  # only those rows read outputs
            for j in range(bmax + 1):
                bans.append(depth_bans(s.seq, self.eos_ids, j))
                outs.append(s.seq.output_token_ids + list(s.draft_token_ids[:j]) if penalised else ())
            masks += grammar_masks(s.seq, self.eos_ids, list(s.draft_token_ids), 0, bmax + 1)
        batch = VerifyBatch.build([x.sampling_params for x in seqs], [len(x) for x in seqs], bmax,
                                  seeds=[x.seed for x in seqs], banned_ids_per_row=bans,
                                  output_ids_per_row=outs,
                                  prompt_ids_per_row=[x.prompt_token_ids for x in seqs],
                                  bitmask_per_row=masks, device=logits.device)
        # the head's argmax of the logits rows stands for verify's scan when the target is those very
        # rows, in order (a view)
        ids = None
        if not copy_rows and row_argmax is not None:
            first = spec[0][1]
            ids = row_argmax[first:first + target.shape[0] * target.shape[1]]
        res = verify(target, drafts.to(logits.device), q, batch, self.runner.sampler, row_argmax=ids)
        acc, tokens = res.num_accepted.tolist(), res.token_ids.tolist()
        found = {}
        for r, (i, _) in enumerate(spec):
            if res.logprobs is None:
                emitted = [(t, None, None, []) for t in tokens[r][:acc[r] + 1]]
            else:
                emitted = [_verified_token(res, r, j) for j in range(acc[r] + 1)]
            found[i] = RowResult(emitted, num_drafts=len(scheduled[i].draft_token_ids), num_accepted=acc[r])
        return found


def _verified_token(res, r: int, j: int) -> tuple:
    """(token_id, logprob, rank, top) of request r's emitted token at depth j of a VerifyOutput."""
    top = []
    if res.top_ids is not None and res.top_logprobs is not None:
        top = list(zip(res.top_ids[r, j].tolist(), res.top_logprobs[r, j].tolist()))
    rank = None if res.token_ranks is None else int(res.token_ranks[r, j])
    return int(res.token_ids[r, j]), float(res.logprobs[r, j]), rank, top


def _target_view(logits: torch.Tensor, spec, num_drafts: list[int], bmax: int) -> torch.Tensor | None:
    """The [R, bmax + 1, V] verification logits as a view of `logits` when every request has bmax
    drafts and their rows follow one another (the usual verification step), else None (the caller
    gathers them). verify() only reads its target, so the view is safe; copying the rows cost 0.2-0.4
    ms of a ~13 ms batch-1 verification step of the tiny V4.1 (4 x 129,280 fp32, torch.profiler)."""
    first = spec[0][1]
    depth = bmax + 1
    if any(n != bmax for n in num_drafts) or [f for _, f in spec] != list(range(first, first + len(spec) * depth, depth)):
        return None
    rows = logits[first:first + len(spec) * depth]
    return rows.view(len(spec), depth, logits.shape[1]) if rows.is_contiguous() else None
