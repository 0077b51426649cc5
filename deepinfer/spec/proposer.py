"""Proposal: the next drafts of every sampling row, from one DSpark draft block (docs/model.md §3.8).

After a step emitted its tokens, each sampling row that can use drafts drafts from the token it
emitted last: the runner runs one draft block of B tokens per sequence (ModelRunner.draft: on a
model over ranks every rank runs it) and returns, per block row, hidden_pre and the base logits.
The drafts are then sampled depth by depth, because the Markov head needs the previous draft
(ModelRunner.draft_heads), with the request's own sampling parameters on the draft stream: seed +
DRAFT_SEED_OFFSET, position of the drafted token, so a draft draw never equals a verify or sample draw
(layers/sample_draw.py). When every row's drafts are plain argmaxes (`argmax_drafts`) the runner may
run the heads with the block instead (ModelRunner.draft_greedy: on Neuron inside the block's compiled
region, so only the drafts and confidences come back); the drafts are the same tokens, ties to the
lowest id either way.

Which rows draft: every sampling row, at most what its next step could emit within max_tokens and
max_model_len. A grammar row (structured_output.py) samples draft k under the grammar's mask after
this step's emitted tokens and drafts d_0 .. d_{k-1} (GrammarState.masks_along walks the matcher
along those uncommitted tokens and rolls it back, so it moves only when the scheduler appends the
emitted tokens, stop_rules.py); drafting stops where the path ends: after a token that completes the
grammar, or before a depth where nothing may follow.
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.model_executor.layers.sample_draw import sample_uniforms
from deepinfer.model_executor.layers.sampler import SamplingBatch
from deepinfer.model_executor.models.dspark_draft import DraftBlock
from deepinfer.step_result import DraftProposal, RowResult
from deepinfer.stop_rules import banned_token_ids

DRAFT_SEED_OFFSET = 1000000007  # upstream DeepInfer's draft stream: drafts sample with seed + this


class DraftProposer:
    # whether a greedy step may verify and draft on the device, its drafts taken through `take_drafts`
    # (spec/decoder.py); a proposer whose drafts come from elsewhere says no
    drafts_on_device = True

    def __init__(self, runner, num_drafts: int, max_model_len: int, eos_ids, noise_id: int):
        """runner: the driver's ModelRunner (worker/model_runner.py); noise_id: the checkpoint's
        dspark_noise_token_id, the token of block rows 1 .. B-1."""
        self.runner = runner
        self.num_drafts = int(num_drafts)
        self.max_model_len = int(max_model_len)
        self.eos_ids = list(eos_ids)
        self.noise_id = int(noise_id)

    def propose(self, scheduled, results: dict[int, RowResult]) -> None:
        """Set results[i].proposal for every sampling row i of `scheduled` that can use drafts;
        results[i].tokens are the tokens row i emitted this step."""
        rows = self.draft_rows(scheduled, results)
        if not rows:
            return
        b = self.num_drafts
        block = DraftBlock(slots=[scheduled[i].seq.state_slot for i, _, _ in rows],
                           last_pos=[new_len - 2 for _, _, new_len in rows],
                           first_tokens=[results[i].tokens[-1][0] for i, _, _ in rows], block=b)
        runner = self.runner
        seqs = [scheduled[i].seq for i, _, _ in rows]
        # this step's emitted tokens: outputs before the drafts (penalties, min_tokens bans)
        extra = [[t[0] for t in results[i].tokens] for i, _, _ in rows]
        if all(argmax_drafts(x, self.eos_ids, len(e), b) for x, e in zip(seqs, extra)):
            got = runner.draft_greedy(block, self.noise_id)
            if got is not None:   # the heads ran with the block: drafts and confidences only
                drafts, confs = got[0].tolist(), got[1].tolist()
                for c, (i, n, _) in enumerate(rows):
                    results[i].proposal = DraftProposal(drafts[c][:n], None, confs[c][:n])
                return
        hidden, base = runner.draft(block, self.noise_id)
        r = len(rows)
        hidden, base = hidden.view(r, b, -1), base.view(r, b, -1)
        sampled_rows = [k for k, x in enumerate(seqs) if not x.sampling_params.is_greedy]
        prev = torch.tensor(block.first_tokens, dtype=torch.long, device=base.device)
        toks, confs = [], []
        q = None   # [sampled rows, B, V]: the heads' logits span the vocabulary (base may not)
        limit = [n for _, n, _ in rows]  # a grammar row drafts no further than its path goes
        depth_batches = DraftDepthBatches(seqs, [nl for _, _, nl in rows], extra, self.eos_ids, b)
        for k in range(b):
            masks = [None] * r  # the grammar's mask after this step's tokens and the drafts so far
            for c, (x, e) in enumerate(zip(seqs, extra)):
                if x.grammar is None or k >= limit[c]:
                    continue
                path = e + [int(t[c]) for t in toks]
                masks[c] = grammar_masks(x, self.eos_ids, path, len(path), 1)[0]
                if masks[c] is None:
                    limit[c] = k
            lg, conf = runner.draft_heads(hidden[:, k], base[:, k], prev)
            confs.append(conf)
            # draft k is the token at position a + 2 + k = new_len + k
            out = runner.sampler(lg, depth_batches.at(k, toks, lg.device, masks),
                                 keep_random_logprobs=bool(sampled_rows))
            if sampled_rows:  # the processed distribution the draws came from (random rows, in order)
                if q is None:
                    q = torch.empty(len(sampled_rows), b, lg.shape[-1])
                q[:, k] = out.random_logprobs.cpu()
            # a row whose draft logits were all masked (a grammar that allows no token of a draft
            # vocabulary, models/draft_vocab.py) draws no real token: its drafting stops at this depth
            ids = out.token_ids.clamp(max=lg.shape[-1] - 1)
            drawn = (out.token_ids < lg.shape[-1]) & torch.isfinite(lg.gather(1, ids[:, None]).squeeze(1))
            for c in torch.nonzero(~drawn).flatten().tolist():
                limit[c] = min(limit[c], k)
            toks.append(ids.tolist())
            prev = ids
        for c, (i, _, _) in enumerate(rows):
            n = limit[c]
            if n == 0:
                continue
            lp = None
            if not seqs[c].sampling_params.is_greedy:
                lp = q[sampled_rows.index(c), :n]
            results[i].proposal = DraftProposal([toks[k][c] for k in range(n)], lp,
                                                [float(confs[k][c]) for k in range(n)])


    def take_drafts(self, scheduled, results: dict[int, RowResult], drafted: dict) -> None:
        """Proposals from drafts made on the device with the step (spec/greedy_step.py): drafted[i] =
        (B argmax drafts, their confidences) of sampling row i, cut to what its next step can use."""
        for i, n, _ in self.draft_rows(scheduled, results):
            ids, confs = drafted[i]
            results[i].proposal = DraftProposal(list(ids[:n]), None, list(confs[:n]))

    def draft_rows(self, scheduled, results: dict[int, RowResult]) -> list[tuple[int, int, int]]:
        """(scheduled index, drafts, length once this step's tokens are appended) of every sampling row
        that can use drafts: at most what its next step could emit within max_tokens and max_model_len."""
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
        return rows


def argmax_drafts(seq, eos_ids, emitted: int, depths: int) -> bool:
    """Whether seq's drafts at every depth are the argmax of the heads' raw logits: a greedy row with
    nothing the sampler would change before its argmax (no grammar mask, logit_bias, penalty, or
    min_tokens ban at any depth; layers/sampler.py step a and 0). Such rows can draft on the device
    (ModelRunner.draft_greedy) with the draws the host sampler would make, ties to the lowest id."""
    p = seq.sampling_params
    return (p.greedy_raw_argmax and seq.grammar is None
            and not any(depth_bans(seq, eos_ids, emitted + k) for k in range(depths)))


def depth_bans(seq, eos_ids, ahead: int) -> tuple[int, ...]:
    """The ids the output `ahead` tokens after seq's current last one may not take (stop_rules.py)."""
    return tuple(banned_token_ids(seq, eos_ids, ahead))


def grammar_masks(seq, eos_ids, path: list[int], first: int, count: int) -> list:
    """Grammar bitmasks of the outputs `first` .. `first + count - 1` tokens after seq's last one, along
    the uncommitted tokens `path` (GrammarState.masks_along); None where the path cannot reach, and
    all None without a grammar."""
    if seq.grammar is None:
        return [None] * count
    masks = seq.grammar.masks_along(path[:first + count - 1], lambda j: depth_bans(seq, eos_ids, j), first)
    return masks + [None] * (count - len(masks))


class DraftDepthBatches:
    """The SamplingBatch of each draft depth. Depth k differs from depth 0 only in its draw positions
    (new_len + k), min_tokens bans (depth_bans) and the outputs penalties read (earlier drafts
    appended); when no row has a penalty and no row's bans change with k, depth 0's batch is reused
    with the depth's draws, instead of rebuilding every per-row tensor each depth."""

    def __init__(self, seqs, new_lens, extra, eos_ids, num_depths: int):
        self.seqs, self.new_lens, self.extra = seqs, new_lens, extra
        self.bans = [[depth_bans(x, eos_ids, len(e) + k) for x, e in zip(seqs, extra)] for k in range(num_depths)]
        self.penalised = [x.sampling_params.penalises_output or x.sampling_params.penalises_repetition
                          for x in seqs]
        # grammar rows have a mask per depth (GrammarState.masks_along): their batches are rebuilt
        self.static = (not any(self.penalised) and all(bk == self.bans[0] for bk in self.bans)
                       and all(x.grammar is None for x in seqs))
        self.seeds = [x.seed + DRAFT_SEED_OFFSET for x in seqs]
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
