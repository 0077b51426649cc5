"""StepFanout: one engine step run by every rank of a model spread over ranks (docs/architecture.md §8).

The driver (rank 0) alone schedules and samples. Per step, through ModelRunner.run:
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
Followers get the message in `receive` and run `ModelRunner.execute` on it (ModelRunner.follow).

The KV pools are full size on every rank, although a rank only ever holds its group's sequences:
with dp > 1 that is dp times the memory the rows need (the scheduler has one block pool for all).
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.distributed import comm
from deepinfer.distributed.step_codec import (KIND_SHUTDOWN, KIND_STEP, GroupStep, StepMessage, decode,
                                              to_bytes)
from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.static_step import Bucket, pad_chunks
from deepinfer.worker.model_runner import PreparedStep

# Extra bytes per ring slot beyond the largest measured step (JSON lengths vary with the numbers).
_SLOT_HEADROOM = 64 << 10


@dataclasses.dataclass
class FanoutStep:
    message: StepMessage | None     # the driver's whole step (None on a follower)
    gather_rows: int                # logits rows every group leader contributes
    order: torch.Tensor | None = None  # driver, dp > 1: gathered row of each real logits row, chunk order


def _logit_rows(chunks: list[SeqChunk]) -> int:
    return sum(min(c.num_logits, c.num_new) for c in chunks)


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


class StepFanout:
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
            n = _logit_rows(chunks)
            msg = StepMessage(KIND_STEP, [GroupStep(step, bucket, n)], n)
            return PreparedStep(strategy.to_device(step, bucket), bucket, n, FanoutStep(msg, n))
        per, index = split_groups(chunks, dp)
        groups = []
        for g in per:
            step, bucket = strategy.prepare_host(g)
            groups.append(GroupStep(step, bucket, _logit_rows(g)))
        rows = max(g.num_logits for g in groups)
        where = {}
        for g, members in enumerate(index):
            offset = g * rows
            for i in members:
                where[i] = offset
                offset += _logit_rows([chunks[i]])
        order = [r for i, c in enumerate(chunks) for r in range(where[i], where[i] + _logit_rows([c]))]
        msg = StepMessage(KIND_STEP, groups, rows)
        own = groups[self.layout.dp_rank]
        return PreparedStep(strategy.to_device(own.step, own.bucket), own.bucket, own.num_logits,
                            FanoutStep(msg, rows, torch.tensor(order, dtype=torch.long)))

    def publish(self, prepared: PreparedStep) -> None:
        self.channel.send(prepared.fanout.message)
        self.steps_published += 1

    def shutdown(self) -> None:
        """Tell every follower to leave its loop."""
        self.channel.send(StepMessage(KIND_SHUTDOWN))

    # -- every rank ----------------------------------------------------------------------------
    def gather(self, prepared: PreparedStep, logits: torch.Tensor) -> torch.Tensor:
        """The driver: every group's real logits rows in chunk order; another rank: its own rows."""
        fs = prepared.fanout
        if self.layout.dp == 1 or self.groups.dp_leaders is None or fs.gather_rows == 0:
            return logits
        extra = fs.gather_rows - logits.shape[0]
        padded = torch.cat([logits, logits.new_zeros(extra, logits.shape[1])]) if extra else logits
        gathered = comm.all_gather(padded.contiguous(), self.groups.dp_leaders)
        if fs.order is None:
            return logits
        return gathered.index_select(0, fs.order.to(gathered.device))

    # -- followers -----------------------------------------------------------------------------
    def receive(self, strategy) -> PreparedStep | None:
        """This rank's share of the next published step, on its device; None when told to stop."""
        msg = decode(self.channel.receive(), group=self.layout.dp_rank)
        if msg.kind == KIND_SHUTDOWN:
            return None
        if msg.kind != KIND_STEP:
            raise RuntimeError(f"step message of unknown kind {msg.kind}")
        own = msg.groups[self.layout.dp_rank]
        return PreparedStep(strategy.to_device(own.step, own.bucket), own.bucket, own.num_logits,
                            FanoutStep(None, msg.gather_rows))


def slot_bytes(strategy, engine_config, dp: int) -> int:
    """Ring slot size for every step a valid config can schedule: the encoded size of the largest
    steps (max_num_batched_tokens tokens at the end of a max_model_len context, alone or beside
    max_num_seqs - 1 decode rows), built by the strategy itself (buckets and padding included), for
    each of the dp groups, plus headroom."""
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
    largest = 0
    for chunks in cases:
        step, bucket = strategy.prepare_host(chunks)
        msg = StepMessage(KIND_STEP, [GroupStep(step, bucket, _logit_rows(chunks))], 0)
        largest = max(largest, len(to_bytes(msg)))
    return dp * (largest + largest // 4) + _SLOT_HEADROOM
