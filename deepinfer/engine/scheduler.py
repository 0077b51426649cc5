"""Scheduler: waiting/running queues, chunked prefill, preemption by recompute.

One step mixes decodes and prefill chunks under `max_num_seqs` and `max_num_batched_tokens`:
  1. every running sequence whose prefill is done decodes (1 token each, arrival order);
  2. running sequences with an unfinished prefill get their next chunk;
  3. waiting sequences are admitted FCFS (skipped in a step that preempted, to avoid thrashing).
A chunk samples (`do_sample`) only when it reaches the end of the sequence's known tokens.

When the pool cannot cover a sequence's next tokens, the most recently arrived running sequence
that is not yet scheduled this step is preempted: its blocks and state slot are freed, its
computed count drops to 0 and it goes to the front of `waiting`, to be prefilled again (prompt +
the outputs it already has). The sampler keys its random draws on (seed, position), so a
recomputed sequence produces the same tokens it would have without preemption.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine_config import EngineConfig
from deepinfer.outputs import Logprob
from deepinfer.sequence import Sequence, SequenceStatus
from deepinfer.spec.verify_policy import VerifyPolicy
from deepinfer.step_result import StepResult
from deepinfer.stop_rules import apply_stop_rules


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step: seq.token_ids[computed : computed + num_new_tokens]
    do_sample: bool  # sample one token after the last fed token
    is_decode: bool = False  # feeds the last sampled token (the prompt was already prefilled)
    # Drafts this row verifies (a prefix of seq.draft_token_ids): it feeds [last sampled token] +
    # draft_token_ids (speculative decoding, spec/verify_policy.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Set by the worker: one {token_id: Logprob} per position of prompt_logprob_positions.
    prompt_logprobs: list[dict] | None = None
    # Prefix caching (model_executor/prefix_state.py): the first restore_len positions came from cached
    # blocks at admission; blocks completing at or before snapshot_upto store their boundary state.
    restore_len: int = 0
    snapshot_upto: int = 0

    @property
    def start_pos(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Prompt positions whose logprob this chunk computes: position p is scored by the logits
        row of position p - 1, so a chunk covers (start, start + num_new] within the prompt, minus
        what the sequence already has (a prefill recomputed after preemption repeats nothing)."""
        seq = self.seq
        if seq.prompt_logprobs is None:
            return range(0)
        first = max(self.start_pos + 1, len(seq.prompt_logprobs))
        return range(first, max(first, min(self.start_pos + self.num_new_tokens, seq.prompt_len - 1) + 1))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _arrival_key(seq: Sequence):
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, engine_config: EngineConfig, block_manager: BlockManager,
                 eos_token_ids: list[int] | tuple[int, ...] = ()):
        assert engine_config.max_model_len is not None, "resolve the EngineConfig first"
        self.config = engine_config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order: the tail is the preemption victim
        self.num_preemptions = 0
        # which drafts each row verifies, the step times and calibration behind it, the counters
        self.spec_policy = VerifyPolicy(engine_config.speculative_verify)

    # ---- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request as aborted and free its cache; returns them."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        aborted += [s for s in self.running if s.request_id == request_id]
        if not aborted:
            return []
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        for seq in aborted:
            self.block_manager.free(seq)
            seq.finish(SequenceStatus.FINISHED_ABORTED)
        return aborted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        # The drafts stay: the recomputed prefill's last chunk verifies them (the same draws).
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _insert_running(self, seq: Sequence) -> None:
        keys = [_arrival_key(s) for s in self.running]
        self.running.insert(bisect.bisect(keys, _arrival_key(seq)), seq)

    # ---- scheduling -----------------------------------------------------------------------
    def _fit_drafts(self, seq: Sequence, want: int, budget: int) -> tuple[int, list[int]]:
        """(tokens, drafts) of a prompt chunk of `want` tokens (VerifyPolicy.fit_prompt_chunk)."""
        if not seq.draft_token_ids:
            return want, []
        room = min(budget, self.block_manager.max_tokens_coverable(seq) - seq.num_computed_tokens)
        return self.spec_policy.fit_prompt_chunk(seq, want, room)

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        taken: set[int] = set()  # seq_ids scheduled this step (never preempted afterwards)

        for seq in self.running:
            assert seq.num_pending_tokens >= 1, f"running seq {seq.seq_id} has nothing to compute"
        decodes = [s for s in self.running if s.num_pending_tokens == 1]
        prefills = [s for s in self.running if s.num_pending_tokens > 1]
        verify = self._plan_drafts(decodes, budget)

        for seq in decodes + prefills:
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            is_decode = seq.num_pending_tokens == 1
            # A decode row verifies the drafts planned for it (all of them unless speculative_verify is
            # "confidence": the sampled draws depend on how many), or waits for a step with room.
            want = 1 + verify.get(seq.seq_id, 0) if is_decode else min(seq.num_pending_tokens, budget)
            if want < 1 or want > budget:
                continue
            while True:
                if is_decode:
                    fits = bm.can_allocate(seq, seq.num_computed_tokens + want)
                else:
                    # A prefill chunk shrinks to what the pool can hold before anyone is evicted.
                    want = min(want, bm.max_tokens_coverable(seq) - seq.num_computed_tokens)
                    fits = want >= 1
                if fits:
                    break
                victim = next(s for s in reversed(self.running) if s.seq_id not in taken)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            if is_decode:
                drafts = list(seq.draft_token_ids[:want - 1])
            else:
                want, drafts = self._fit_drafts(seq, want, budget)
                want += len(drafts)
            # A decode row feeds the last sampled token (a 1-token prompt tail is prefill).
            self._schedule(out, seq, want, is_decode and seq.num_output_tokens > 0, drafts)
            taken.add(seq.seq_id)
            budget -= want

        # Admitting new work in a step that had to evict would only evict it again.
        while self.waiting and not out.preempted and budget > 0 \
                and len(self.running) < self.config.max_num_seqs and bm.num_free_state_slots > 0:
            seq = self.waiting[0]
            hit = bm.admit_cached(seq)  # its slot, and the blocks of its cached prompt prefix
            want = min(seq.num_pending_tokens, budget,
                       bm.max_tokens_coverable(seq) - seq.num_computed_tokens)
            if want < 1:
                bm.free(seq)
                seq.num_computed_tokens = 0
                break  # FCFS: the head waits for blocks; nobody overtakes it
            want, drafts = self._fit_drafts(seq, want, budget)
            want += len(drafts)
            self.waiting.popleft()
            if bm.prefix_cache is not None:
                bm.prefix_cache.record_query(len(seq), hit)
                if seq.first_scheduled_time is None:
                    seq.num_cached_tokens = hit
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            self._schedule(out, seq, want, drafts=drafts, restore_len=hit)
            budget -= want

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _plan_drafts(self, decodes: list[Sequence], budget: int) -> dict[int, int]:
        """seq_id -> drafts its decode row verifies this step (VerifyPolicy.plan)."""
        return self.spec_policy.plan(decodes, budget)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, num_new_tokens: int,
                  is_decode: bool = False, drafts: list[int] | None = None, restore_len: int = 0) -> None:
        # KV blocks cover the drafts too; those of rejected drafts stay with the sequence (it grows
        # into them) and their entries are never read before they are rewritten (docs/model.md §5.3).
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new_tokens)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.time()
        drafts = list(drafts or ())
        do_sample = seq.num_computed_tokens + num_new_tokens - len(drafts) == len(seq)
        cacheable = self.block_manager.cacheable_len(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new_tokens, do_sample, is_decode, draft_token_ids=drafts,
                                          restore_len=restore_len,
                                          snapshot_upto=cacheable if seq.num_computed_tokens < cacheable else 0))

    # ---- results --------------------------------------------------------------------------
    def update(self, scheduled: list[ScheduledSeq], result: StepResult | None) -> list[Sequence]:
        """Apply one step's results; returns the sequences that got a token (finished included).

        `result` holds one row per ScheduledSeq with do_sample, in order (step_result.py); it may be
        None when nothing samples.
        """
        rows = result.rows if result is not None else []
        num_sampling = sum(1 for item in scheduled if item.do_sample)
        assert len(rows) == num_sampling, f"the step returned {len(rows)} rows for {num_sampling} do_sample chunks"
        next_row = iter(rows)
        changed: list[Sequence] = []
        for item in scheduled:
            seq = item.seq
            group = next(next_row) if item.do_sample else None
            if seq.status != SequenceStatus.RUNNING:  # aborted between schedule and update
                continue
            if item.prompt_logprobs:
                assert len(item.prompt_logprobs) == len(item.prompt_logprob_positions)
                seq.prompt_logprobs.extend(item.prompt_logprobs)
            # Only the fed token and the accepted drafts are committed; rejected ones leave the length.
            accepted = len(group.tokens) - 1 if group is not None else 0
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + accepted
            assert seq.num_computed_tokens <= len(seq) + accepted
            if item.snapshot_upto:
                self.block_manager.register(seq)
            if group is None:
                continue
            seq.num_last_emitted = 0
            for token_id, logprob, rank, top in group.tokens:  # stop rules per emitted token
                entry = None
                if seq.logprobs is not None:
                    entry = _logprob_entry(token_id, logprob, rank, top,
                                           seq.sampling_params.logprobs or 0)
                seq.append_token(token_id, logprob, entry)
                seq.num_last_emitted += 1
                apply_stop_rules(seq, self.eos_token_ids, self.config.max_model_len)
                if seq.is_finished:
                    break
            if item.is_decode:
                # seq's drafts are still the ones this row held (set_drafts below replaces them)
                self.spec_policy.record_row(seq, len(item.draft_token_ids), group.num_accepted, seq.num_last_emitted)
            changed.append(seq)
            if seq.is_finished:
                self.running.remove(seq)
                self.block_manager.free(seq)
                seq.set_drafts(None)
            else:
                seq.set_drafts(group.proposal)
        if any(item.is_decode for item in scheduled):
            self.spec_policy.record_step()
        return changed


def _logprob_entry(token_id, logprob, rank, top, num_top: int) -> dict[int, Logprob]:
    """{token id: Logprob} for one output token: the sampled token plus this request's top-N
    (the batch's top list is as wide as the widest request, in descending order)."""
    entry = {token_id: Logprob(float(logprob) if logprob is not None else float("nan"),
                               int(rank) if rank is not None else None)}
    for r, (tid, lp) in enumerate(top[:num_top], start=1):
        entry.setdefault(int(tid), Logprob(float(lp), r))
    return entry

