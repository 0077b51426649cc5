"""A greedy speculative step as one device program: verification forward, acceptance, draft block.

When every sampling row of a step is greedy with nothing the sampler would change before its argmax
(`on_device_step`), the host needs nothing between the verification forward and the next draft block:
the tokens are the argmaxes of the verification rows, the accepted length is where they first differ
from the drafts (spec/verify.py's greedy rule, ties to the lowest id as the sampler's `first_argmax`),
and the draft block starts from the last emitted token at the position after the last accepted one
(spec/proposer.py: a = new_len - 2). So `verify_and_draft` does all of it on the device, reading the
step's logits where the exit left them and the main keys the forward just wrote into the draft layers'
rings (the target features of the accepted positions; models/dspark_draft.py), and returns one fp32
tensor: the host copies back only that (`GreedySpecOutput`). The step's inputs carry the plan's
`meta` beside its metadata, so one copy goes each way (worker/runners/neuron_regions.py).

The block runs for every sampling row, whatever it accepts: a row whose next step can take no draft
(max_tokens, max_model_len) gets drafts the host drops (DraftProposer.draft_rows decides, as on the
host path). Rows that need the host (sampled, logprobs, bans, penalties, grammar, prompt logprobs in
the step) keep the host path (spec/decoder.py), decided per step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.model_executor.layers.row_argmax import first_argmax
from deepinfer.model_executor.models.dspark_draft import (draft_block_inputs, draft_forward, greedy_drafts,
                                                          pad_draft_tokens)
from deepinfer.spec.proposer import argmax_drafts
from deepinfer.spec.verify import NO_TOKEN, accepted_prefix


def on_device_step(scheduled, eos_ids, num_drafts: int, scores) -> bool:
    """Whether this step can verify and draft on the device: no prompt logprobs, at least one sampling
    row, and every sampling row greedy with plain argmaxes at every verification and draft depth it can
    reach this step and the next (argmax_drafts over 2B + 1 outputs), without logprobs."""
    rows = [s for s in scheduled if s.do_sample]
    if scores or not rows:
        return False
    return all(s.seq.sampling_params.logprobs is None
               and argmax_drafts(s.seq, eos_ids, 0, 2 * num_drafts + 1) for s in rows)


@dataclass
class GreedySpecPlan:
    """The sampling rows of a step, in scheduled order, as the device program reads them.

    Row r: its verification logits rows (`first[r]` .. `first[r] + n[r]`, the exit's rows in chunk
    order), its n[r] <= B drafts, its state slot and the position of its last fed token x0."""
    index: list[int]       # scheduled index of each sampling row
    first: list[int]       # its first logits row
    drafts: list[list[int]]
    slots: list[int]
    x0_pos: list[int]      # len(seq) - 1: verification row 0 produces the token at x0_pos + 1
    num_drafts: int        # B

    @classmethod
    def build(cls, scheduled, chunks, num_drafts: int) -> GreedySpecPlan:
        index, first, drafts, slots, pos = [], [], [], [], []
        row = 0
        for i, (s, c) in enumerate(zip(scheduled, chunks)):
            n_rows = min(c.num_logits, c.num_new)
            if s.do_sample:
                d = list(s.draft_token_ids)
                index.append(i)
                first.append(row + n_rows - (1 + len(d)))
                drafts.append(d)
                slots.append(s.seq.state_slot)
                pos.append(len(s.seq) - 1)
            row += n_rows
        return cls(index, first, drafts, slots, pos, int(num_drafts))

    def __len__(self) -> int:
        return len(self.index)

    def for_group(self, chunks, members: list[int]) -> GreedySpecPlan:
        """The plan of the step's chunks `members` (indices into `chunks`, in the order a data-parallel
        group runs them: executor/step_fanout.py split_groups), each row's logits rows renumbered as the
        group's own step has them (its chunks' logits rows one after another, placeholders after)."""
        start, row = [], 0
        for c in chunks:
            start.append(row)
            row += min(c.num_logits, c.num_new)
        own, row = {}, 0
        for i in members:
            own[i] = row
            row += min(chunks[i].num_logits, chunks[i].num_new)
        keep = sorted((r for r, i in enumerate(self.index) if i in own), key=lambda r: own[self.index[r]])
        return GreedySpecPlan([self.index[r] for r in keep],
                              [self.first[r] - start[self.index[r]] + own[self.index[r]] for r in keep],
                              [self.drafts[r] for r in keep], [self.slots[r] for r in keep],
                              [self.x0_pos[r] for r in keep], self.num_drafts)

    def meta(self, rows: int) -> torch.Tensor:
        """int64 [rows, 2B + 4]: per row the logits row of each depth 0..B (a depth past the row's
        drafts repeats its last row, never read), the drafts (NO_TOKEN where none), slot, x0 position
        and 1 for a real row; placeholder rows (scratch slot 0) up to `rows`."""
        b = self.num_drafts
        m = torch.zeros(rows, 2 * b + 4, dtype=torch.long)
        m[:, 1 + b:1 + 2 * b] = NO_TOKEN
        for r, (f, d) in enumerate(zip(self.first, self.drafts)):
            m[r, :1 + b] = torch.tensor([f + min(j, len(d)) for j in range(1 + b)])
            m[r, 1 + b:1 + b + len(d)] = torch.tensor(d, dtype=torch.long)
            m[r, 1 + 2 * b:] = torch.tensor([self.slots[r], self.x0_pos[r], 1])
        return m


def greedy_accept(logits: torch.Tensor, rows_idx: torch.Tensor, drafts: torch.Tensor):
    """(tokens [R, 1+B] int64, accepted [R] int64): the argmax of each verification row (lowest id on
    ties) and the count of leading drafts equal to it; a NO_TOKEN draft never matches."""
    r, depth = rows_idx.shape
    tokens = first_argmax(logits.index_select(0, rows_idx.reshape(-1)).float().contiguous()).view(r, depth)
    return tokens, accepted_prefix(tokens[:, :depth - 1] == drafts)


def verify_and_draft(model, logits: torch.Tensor, meta: torch.Tensor, cache, layout, noise_id: int,
                     block_tokens: int) -> torch.Tensor:
    """fp32 [R, 3B + 2] = [tokens (1+B) | accepted | next drafts (B) | their confidences (B)] of the
    plan's `meta` rows (ids as exact fp32 integers, < 2^24): the step's greedy acceptance, then the
    DSpark draft block of every row from its last emitted token, padded to `block_tokens` tokens."""
    b = (meta.shape[1] - 4) // 2
    # a vocabulary-split head's slices gathered in-graph (the identity on one rank), as the draft block's
    # base logits are: the argmax is over the whole vocabulary
    tokens, acc = greedy_accept(model.full_logits(logits), meta[:, :1 + b], meta[:, 1 + b:1 + 2 * b])
    slot, x0_pos, real = meta[:, 1 + 2 * b], meta[:, 2 + 2 * b], meta[:, 3 + 2 * b] > 0
    last = tokens.gather(1, acc[:, None]).squeeze(1)            # the token emitted last, at x0_pos + acc + 1
    block = draft_block_inputs(slot, x0_pos + acc, last, b, layout, noise_id, real)
    step = dataclasses.replace(pad_draft_tokens(block, block_tokens, layout), static_shapes=True)
    hidden, base = draft_forward(model, step, cache)
    n = meta.shape[0] * b
    drafts, conf = greedy_drafts(model, hidden[:n], model.draft_columns(base[:n]), last, b)
    return torch.cat([tokens.float(), acc[:, None].float(), drafts.float(), conf], dim=1)


@dataclass
class GreedySpecOutput:
    """The host's reading of `verify_and_draft`'s rows (the real ones, in plan order)."""
    tokens: list[list[int]]     # emitted tokens: the accepted drafts, then the argmax after them
    accepted: list[int]
    drafts: list[list[int]]     # B next drafts of each row
    confidences: list[list[float]]

    @classmethod
    def parse(cls, out: torch.Tensor, rows: int, num_drafts: int) -> GreedySpecOutput:
        b = num_drafts
        out = out[:rows]
        tok = out[:, :1 + b].long().tolist()
        acc = out[:, 1 + b].long().tolist()
        return cls([t[:a + 1] for t, a in zip(tok, acc)], acc, out[:, 2 + b:2 + 2 * b].long().tolist(),
                   out[:, 2 + 2 * b:].tolist())
