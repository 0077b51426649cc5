"""StepFanout: one engine step run by every rank of a model spread over ranks (docs/architecture.md §8).

It is the multi-rank form of the ModelRunner's transport (worker/step_transport.py; one rank uses
SingleRankTransport), and the only code that knows the step message's wire kinds. The driver
(rank 0) alone schedules and samples. Per step, through ModelRunner.run:
- prepare: with one CP group (dp = 1) the step is the scheduler's rows. With data-parallel attention
  (expert_parallel_size > context_parallel_size, dp = ep / cp CP groups), each chunk goes to group
  `state_slot % dp` (a sequence keeps its slot, so its KV stays on its group's ranks), and every group
  is padded with placeholder chunks (scratch slot 0: no expert, no logits) to the same token count,
  because every rank of an EP group must feed its MoE collectives the same number of rows. Each
  group's inputs are built on the host by the runner strategy (bucket and padding included);
- publish: every group's inputs go out as one message (distributed/step_channel.py);
- execute: every rank runs its group's step through the same strategy forward (same graphs); the
  first rank of each CP group then all-gathers its group's real logits rows, padded to the step's
  largest group, over `ParallelGroups.dp_leaders`, and the driver puts them back in chunk order.
Followers get the message in `receive` and run `ModelRunner.execute` on it (`follow`).

Speculative decoding adds a second message per step: the DSpark draft block (`prepare_draft`), which
every rank runs through the draft layers (their MoE and lane attention have collectives). Its rows are
shared out like a step's (group `state_slot % dp`, each group padded with placeholder rows to the
largest group), and the group leaders all-gather [hidden_pre | base logits] per row so the driver
samples the drafts (ModelRunner.draft, `gather_draft`); followers run it through
`ModelRunner.execute_draft`. When every row drafts by argmax the heads run in the block's program on
every rank and only [drafts | confidences] a sequence is gathered (`prepare_draft(greedy=True)`,
ModelRunner.draft_greedy / execute_draft_greedy). A step whose sampling rows are all greedy can
instead be one message and one device program on every rank (`prepare_greedy_spec`,
spec/greedy_step.py): each group's verification step with its share of the plan; the group leaders
all-gather the programs' outputs (tokens, accepted counts, next drafts) and the driver puts them in
plan order; followers run it through `ModelRunner.execute_greedy_spec`.

The KV pools are full size on every rank, although a rank only ever holds its group's sequences:
with dp > 1 that is dp times the memory the rows need (the scheduler has one block pool for all).
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.distributed import comm
from deepinfer.distributed.step_codec import (KIND_DRAFT, KIND_DRAFT_GREEDY, KIND_GREEDY_SPEC, KIND_SHUTDOWN,
                                              KIND_STEP, GroupStep, StepMessage, decode, to_bytes)
from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.model_executor.layers.vocab_parallel import HeadPlan
from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
from deepinfer.model_executor.static_step import Bucket, pad_chunks
from deepinfer.worker.step_transport import PreparedStep, logit_rows

# Extra bytes per ring slot beyond the largest measured step (JSON lengths vary with the numbers).
_SLOT_HEADROOM = 64 << 10


@dataclasses.dataclass
class FanoutStep:
    message: StepMessage | None     # the driver's whole step (None on a follower)
    gather_rows: int                # logits rows every group leader contributes
    order: torch.Tensor | None = None  # driver, dp > 1: gathered row of each real logits row, chunk order
    kind: int = KIND_STEP           # KIND_STEP (a main forward), KIND_DRAFT / KIND_DRAFT_GREEDY (a draft
    #                                 block: its rows / its argmax drafts) or KIND_GREEDY_SPEC (a greedy
    #                                 verification step and its next draft block)


def split_groups(chunks: list[SeqChunk], dp: int) -> tuple[list[list[SeqChunk]], list[list[int]]]:
    """Each group's chunks padded to equal token counts with placeholder chunks (static_step.pad_chunks:
    scratch slot 0, no logits), and the chunk indices of its real chunks.

    A decode-only step stays decode-shaped: groups are padded with one-token placeholder rows to the
    largest group's row count, so every group selects the same row bucket. A step with a prompt chunk
    gives every group one placeholder chunk of at least two tokens (every group then selects a prompt
    bucket of the same token count)."""
    per: list[list[SeqChunk]] = [[] for _ in range(dp)]
    index: list[list[int]] = [[] for _ in range(dp)]
    for i, c in enumerate(chunks):
        if c.slot <= 0:
            raise ValueError(f"chunk {i}: state slot {c.slot} (slot 0 is the scratch slot)")
        per[c.slot % dp].append(c)
        index[c.slot % dp].append(i)
    if all(c.num_new == 1 for c in chunks):
        rows = max(len(g) for g in per)
        return [pad_chunks(g, Bucket(num_seqs=rows, num_tokens=rows)) for g in per], index
    tokens = [sum(c.num_new for c in g) for g in per]
    target = max(tokens)
    # a group whose placeholder would be shorter than 2 tokens and holds only decode rows would pick a
    # decode bucket: grow every group by the same amount instead
    short = [target - t for g, t in zip(per, tokens) if all(c.num_new == 1 for c in g)]
    if short and min(short) < 2:
        target += 2 - min(short)
    return [pad_chunks(g, Bucket(num_seqs=len(g) + (target > t), num_tokens=target)) for g, t in zip(per, tokens)], index


def gather_order(index: list[list[int]], sizes: list[int], stride: int) -> torch.Tensor:
    """Where each item's rows land in the group leaders' all-gather, in item order: group g's rows
    start at g * stride, its members (index[g]) one after another, item i holding sizes[i] rows."""
    where = {}
    for g, members in enumerate(index):
        offset = g * stride
        for i in members:
            where[i] = offset
            offset += sizes[i]
    return torch.tensor([r for i, n in enumerate(sizes) for r in range(where[i], where[i] + n)], dtype=torch.long)


class StepFanout:
    """The transport of a model spread over ranks (worker/step_transport.py StepTransport)."""

    def __init__(self, layout, groups, channel):
        """layout: this rank's ParallelLayout; groups: its ParallelGroups; channel: its StepChannel."""
        self.layout = layout
        self.groups = groups
        self.channel = channel
        self.steps_published = 0

    # -- driver ------------------------------------------------------------------------------
    def prepare(self, strategy, chunks: list[SeqChunk]) -> PreparedStep:
        dp = self.layout.dp
        if dp == 1:
            step, bucket = strategy.prepare_host(chunks)
            n = logit_rows(chunks)
            msg = StepMessage(KIND_STEP, [GroupStep(step, bucket, n)], n)
            return PreparedStep(strategy.to_device(step, bucket), bucket, n, FanoutStep(msg, n))
        per, index = split_groups(chunks, dp)
        groups = []
        # the driver picks every group's bucket from its real chunks, one token count for all
        # (BucketSpec.common_buckets; the bucket's own placeholders pad each group)
        real = [[chunks[i] for i in members] for members in index]
        buckets = strategy.group_buckets(real)
        for i, g in enumerate(per):
            if buckets is None:
                step, bucket = strategy.prepare_host(g)
            elif buckets[i] is None:   # no bucket holds every group: all run eagerly, unpadded
                step, bucket = build_step_inputs(g, strategy.layout), None
            else:
                step, bucket = strategy.prepare_host(real[i], buckets[i])
            groups.append(GroupStep(step, bucket, logit_rows(g)))
        rows = max(g.num_logits for g in groups)
        order = gather_order(index, [logit_rows([c]) for c in chunks], rows)
        msg = StepMessage(KIND_STEP, groups, rows)
        own = groups[self.layout.dp_rank]
        return PreparedStep(strategy.to_device(own.step, own.bucket), own.bucket, own.num_logits,
                            FanoutStep(msg, rows, order))

    def prepare_draft(self, strategy, block: DraftBlock, noise_id: int, greedy: bool = False) -> PreparedStep:
        """A draft block shared out like a step (module docstring); num_logits counts its B rows per
        sequence, which come back from `gather` in the block's row order. greedy: every row drafts by
        argmax with the heads in the block's program (ModelRunner.draft_greedy): one row a sequence
        comes back, [B drafts | B confidences]."""
        b, dp, layout = block.block, self.layout.dp, strategy.layout
        kind, per_seq = (KIND_DRAFT_GREEDY, 1) if greedy else (KIND_DRAFT, b)
        if dp == 1:
            step = draft_step_inputs(block.padded(strategy.draft_rows(len(block))), layout, noise_id)
            n = len(block) * per_seq
            msg = StepMessage(kind, [GroupStep(step, None, n)], n)
            return PreparedStep(strategy.draft_to_device(step), None, n, FanoutStep(msg, n, kind=kind))
        index = [[r for r, slot in enumerate(block.slots) if slot % dp == g] for g in range(dp)]
        rows = strategy.draft_rows(max(len(i) for i in index))
        groups = [GroupStep(draft_step_inputs(block.rows(members).padded(rows), layout, noise_id), None,
                            len(members) * per_seq) for members in index]
        order = gather_order(index, [per_seq] * len(block), rows * per_seq)
        msg = StepMessage(kind, groups, rows * per_seq)
        own = groups[self.layout.dp_rank]
        return PreparedStep(strategy.draft_to_device(own.step), None, own.num_logits,
                            FanoutStep(msg, rows * per_seq, order, kind=kind))

    def prepare_greedy_spec(self, strategy, chunks: list[SeqChunk], plan) -> PreparedStep | None:
        """A greedy verification step as one device program on every rank (spec/greedy_step.py), shared
        out like a step (each group its real chunks, in a bucket of the token count common to all groups:
        BucketSpec.common_buckets) with each group's share of the plan; every group runs the same block rows (those of the largest group's plan), and the
        group leaders all-gather their [rows, 3B + 2] outputs, which `gather` puts in plan order. None
        where a group's step is not a greedy speculative step the strategy can run (the host verifies;
        nothing was published)."""
        dp = self.layout.dp
        if dp == 1:
            per, plans, buckets = [chunks], [plan], [None]
        else:
            index = split_groups(chunks, dp)[1]
            per = [[chunks[i] for i in members] for members in index]   # each group's real chunks
            plans = [plan.for_group(chunks, members) for members in index]
            buckets = strategy.group_buckets(per)   # one token count for all (BucketSpec.common_buckets)
            if buckets is None or None in buckets:
                return None
        # every group's bucket has one token count (common_buckets) and every group asks for the largest
        # plan, so every group gets the same block rows
        most = max(len(p) for p in plans)
        groups = []
        for g, p, b in zip(per, plans, buckets):
            got = strategy.greedy_spec_inputs(g, most, b)
            if got is None:
                return None
            step, bucket, rows = got
            groups.append(GroupStep(step, bucket, len(p), p.meta(rows)))
        # plan row r of group g comes back at g * rows + its place in g's plan
        where = {i: g * rows + k for g, p in enumerate(plans) for k, i in enumerate(p.index)}
        order = None if dp == 1 else torch.tensor([where[i] for i in plan.index], dtype=torch.long)
        msg = StepMessage(KIND_GREEDY_SPEC, groups, rows)
        own = groups[self.layout.dp_rank]
        return PreparedStep(strategy.greedy_spec_to_device(own.step, own.bucket, own.plan), own.bucket, len(plan),
                            FanoutStep(msg, rows, order, kind=KIND_GREEDY_SPEC))

    def publish(self, prepared: PreparedStep) -> None:
        """Send the step; a head plan (prepared.head, the step's rows in chunk order) goes out split
        by group, and prepared.head becomes this rank's group's share."""
        if prepared.head is not None:
            plans = [prepared.head.rows(r) for r in self._group_rows(prepared)]
            prepared.fanout.message.head = [p.to_json() for p in plans]
            prepared.head = plans[self.layout.dp_rank]
        self.channel.send(prepared.fanout.message)
        self.steps_published += 1

    def _group_rows(self, prepared: PreparedStep) -> list[list[int]]:
        """Per group, its logits rows (chunk-order indices) in the group's own order."""
        fs = prepared.fanout
        if fs.order is None:
            return [list(range(prepared.num_logits))]
        where = fs.order.tolist()
        rows: list[list[int]] = [[] for _ in range(self.layout.dp)]
        for i in sorted(range(len(where)), key=where.__getitem__):
            rows[where[i] // fs.gather_rows].append(i)
        return rows

    def shutdown(self) -> None:
        """Tell every follower to leave its loop."""
        self.channel.send(StepMessage(KIND_SHUTDOWN))

    # -- every rank ----------------------------------------------------------------------------
    def gather(self, prepared: PreparedStep, logits: torch.Tensor) -> torch.Tensor:
        """The driver: every group's real logits rows in chunk order; another rank: its own rows.
        (Of a draft block: its rows of [hidden_pre | base logits], in the block's row order.)"""
        fs = prepared.fanout
        if self.layout.dp == 1 or self.groups.dp_leaders is None or fs.gather_rows == 0:
            return logits
        extra = fs.gather_rows - logits.shape[0]
        padded = torch.cat([logits, logits.new_zeros(extra, logits.shape[1])]) if extra else logits
        gathered = comm.all_gather(padded.contiguous(), self.groups.dp_leaders)
        if fs.order is None:
            return logits
        return gathered.index_select(0, fs.order.to(gathered.device))

    def gather_draft(self, prepared: PreparedStep, hidden: torch.Tensor,
                     base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather` of a draft block's rows: one gather for both, hidden_pre travelling as fp32 beside
        the fp32 base logits."""
        d = hidden.shape[1]
        rows = self.gather(prepared, torch.cat([hidden.float(), base], dim=1)[: prepared.num_logits])
        return rows[:, :d].to(hidden.dtype), rows[:, d:]

    # -- followers -----------------------------------------------------------------------------
    @torch.inference_mode()
    def follow(self, runner) -> int:
        """A follower's loop: run every step the driver publishes through runner.execute (the same
        strategy forward, no sampling), every draft block through runner.execute_draft (or
        runner.execute_draft_greedy when its rows draft by argmax) and every greedy
        speculative program through runner.execute_greedy_spec, until the driver says stop; returns the
        number of messages run."""
        steps = 0
        while (prepared := self.receive(runner.strategy)) is not None:
            if prepared.fanout.kind == KIND_DRAFT:
                runner.execute_draft(prepared)
            elif prepared.fanout.kind == KIND_DRAFT_GREEDY:
                runner.execute_draft_greedy(prepared)
            elif prepared.fanout.kind == KIND_GREEDY_SPEC:
                runner.execute_greedy_spec(prepared)
            else:
                runner.execute(prepared)
            steps += 1
        return steps

    def receive(self, strategy) -> PreparedStep | None:
        """This rank's share of the next published step, on its device; None when told to stop."""
        msg = decode(self.channel.receive(), group=self.layout.dp_rank)
        if msg.kind == KIND_SHUTDOWN:
            return None
        own = msg.groups[self.layout.dp_rank]
        if msg.kind in (KIND_DRAFT, KIND_DRAFT_GREEDY):
            return PreparedStep(strategy.draft_to_device(own.step), None, own.num_logits,
                                FanoutStep(None, msg.gather_rows, kind=msg.kind))
        if msg.kind == KIND_GREEDY_SPEC:
            return PreparedStep(strategy.greedy_spec_to_device(own.step, own.bucket, own.plan), own.bucket,
                                own.num_logits, FanoutStep(None, msg.gather_rows, kind=KIND_GREEDY_SPEC))
        if msg.kind != KIND_STEP:
            raise RuntimeError(f"step message of unknown kind {msg.kind}")
        head = None if msg.head is None else HeadPlan.from_json(msg.head[self.layout.dp_rank])
        return PreparedStep(strategy.to_device(own.step, own.bucket), own.bucket, own.num_logits,
                            FanoutStep(None, msg.gather_rows), head)


def slot_bytes(strategy, engine_config, dp: int) -> int:
    """Ring slot size for every step a valid config can schedule: the encoded size of the largest
    steps (max_num_batched_tokens tokens at the end of a max_model_len context, alone or beside
    max_num_seqs - 1 decode rows; with speculative decoding also verification rows of 1 + B tokens
    and the draft block of max_num_seqs sequences), built by the strategy itself (buckets and padding
    included), for each of the dp groups, plus headroom."""
    tokens, max_len = int(engine_config.max_num_batched_tokens), int(engine_config.max_model_len)
    seqs = int(engine_config.max_num_seqs)
    block = int(strategy.layout.block_size)
    table = list(range(1, -(-max_len // block) + 1))
    ids = [1] * max_len

    def chunk(num_new: int, slot: int) -> SeqChunk:
        return SeqChunk(slot=slot, ctx_len=max_len - num_new, num_new=num_new, block_table=table,
                        token_ids=ids, num_logits=num_new)

    def prompt_chunks(total: int, first_slot: int) -> list[SeqChunk]:
        out, slot = [], first_slot
        while total > 0:
            n = min(total, max_len - 1)
            out.append(chunk(n, slot))
            total, slot = total - n, slot + 1
        return out

    cases = [prompt_chunks(tokens, 1), prompt_chunks(tokens + 2, 1)]
    if seqs > 1 and tokens > seqs:
        cases.append([chunk(1, s + 1) for s in range(seqs - 1)] + prompt_chunks(tokens - seqs + 3, seqs))
    cases.append([chunk(1, s + 1) for s in range(seqs)])
    drafts = int(engine_config.num_speculative_tokens)
    if drafts:   # verification rows: 1 + B tokens each, as many as the token budget holds
        rows = max(1, min(seqs, tokens // (1 + drafts)))
        cases.append([chunk(1 + drafts, s + 1) for s in range(rows)])
    largest = 0
    for chunks in cases:
        step, bucket = strategy.prepare_host(chunks)
        # a greedy speculative step carries its plan's rows too: int64 [rows, 2B + 4] (spec/greedy_step.py)
        plan = torch.zeros(len(chunks), 2 * drafts + 4, dtype=torch.long) if drafts else None
        msg = StepMessage(KIND_STEP, [GroupStep(step, bucket, logit_rows(chunks), plan)], 0)
        largest = max(largest, len(to_bytes(msg)))
    if drafts:   # the draft block of every sequence
        block = DraftBlock(list(range(1, seqs + 1)), [max_len - 2] * seqs, [1] * seqs, drafts)
        step = draft_step_inputs(block, strategy.layout, 0)
        largest = max(largest, len(to_bytes(StepMessage(KIND_DRAFT, [GroupStep(step, None, seqs * drafts)], 0))))
    return dp * (largest + largest // 4) + _SLOT_HEADROOM
