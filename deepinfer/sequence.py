"""Sequence: one generated stream of a request (a request with n > 1 owns n sequences).

Token bookkeeping: `token_ids` = prompt + outputs. The first `num_computed_tokens` of them have
their KV / recurrent state in the cache; the rest are pending and get fed to the model by the
next scheduled chunk. A decoding sequence has exactly one pending token (the last sample).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

_U64 = (1 << 64) - 1
_SEED_MASK = (1 << 63) - 1  # seeds stay non-negative in int64 tensors


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def effective_seed(request_seed: int | None, engine_seed: int, seq_id: int, index: int) -> int:
    """The sampling seed of one sequence.

    - Seeded request: seed + index (index = the sequence's place among the request's n outputs),
      so n > 1 gives n different but reproducible streams and n = 1 uses the user's seed as is.
    - Unseeded request: a hash of (engine seed, seq_id). seq_ids are handed out in add order, so
      the same engine seed and the same request order reproduce the same tokens, and because the
      sampler keys its draws on (seed, position) the result never depends on batching or
      preemption.
    """
    if request_seed is not None:
        return (request_seed + index) & _SEED_MASK
    return _splitmix64(((engine_seed & _U64) * 0x9E3779B97F4A7C15 + seq_id) & _U64) & _SEED_MASK


@dataclass
class Sequence:
    request_id: str
    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: Any
    seed: int
    prompt: str | None = None
    index: int = 0  # which of the request's n outputs this is
    arrival_time: float = field(default_factory=time.time)  # wall clock, as RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    # Prefix caching (engine/prefix_cache.py): hashes of the prompt's full blocks (computed once), how
    # many of block_table's blocks are named in the cache, and the prompt positions the first
    # admission found cached (RequestOutput.num_cached_tokens).
    prefix_hashes: list = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Logprob of each sampled output token (always kept: cumulative_logprob needs it).
    token_logprobs: list[float] = field(default_factory=list)
    # Per output token {token_id: outputs.Logprob} (sampled token + top-N); None when not requested.
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    # Per prompt position {token_id: outputs.Logprob} (the prompt token + top-N), None for position 0;
    # None when not requested. Only ever grows: a recomputed prefill scores no position twice.
    prompt_logprobs: list[dict | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # deepinfer.tokenizer.OutputDetokenizer (detokenization + stop strings); None: no tokenizer.
    detokenizer: Any = None
    # deepinfer.structured_output.GrammarState of a structured-output request; None otherwise.
    grammar: Any = None
    # Released output text: stop strings cut out, a possible partial stop string held back until
    # the sequence finishes, so streamed deltas never have to be taken back.
    output_text: str = ""
    # What the engine already reported to the caller (see take_delta).
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    # Speculative decoding: drafts for the next step (verified then, committed only if accepted),
    # their draft distribution q ([n, V] for sampled requests, None for greedy) and confidences.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_logprobs: Any = None
    draft_confidences: list[float] = field(default_factory=list)
    num_last_emitted: int = 0    # tokens the latest step appended (1, or accepted drafts + 1)
    num_decode_steps: int = 0    # decode steps this sequence took part in
    num_decode_tokens: int = 0   # tokens those steps emitted
    num_draft_tokens: int = 0    # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    confidence_error_sum: float = 0.0  # spec/stats.confidence_error over its verified drafts
    # prompt + outputs, kept alongside output_token_ids so reading token_ids copies nothing.
    _token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        assert self.prompt_token_ids, "a sequence needs at least one prompt token"
        self.output_token_ids = list(self.output_token_ids)
        self._token_ids = self.prompt_token_ids + self.output_token_ids

    # ---- token views ---------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """prompt + outputs: the live list (read it, do not mutate it), read by the worker every
        step, so it is not rebuilt per call."""
        assert len(self._token_ids) == len(self), "output_token_ids changed outside append_token"
        return self._token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == self.prompt_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    # ---- mutation ------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float | None = None,
                     logprob_entry: dict | None = None) -> None:
        """Append a sampled token; logprob_entry ({id: Logprob}) is kept when logprobs were asked."""
        lp = float(logprob) if logprob is not None else 0.0
        self.output_token_ids.append(int(token_id))
        self._token_ids.append(int(token_id))
        self.token_logprobs.append(lp)
        self.cumulative_logprob += lp
        if self.logprobs is not None:
            self.logprobs.append(logprob_entry if logprob_entry is not None else {})
        now = time.time()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def set_drafts(self, proposal) -> None:
        """Keep a step_result.DraftProposal for the next step (None: no drafts)."""
        if proposal is None:
            self.draft_token_ids, self.draft_logprobs, self.draft_confidences = [], None, []
        else:
            self.draft_token_ids = list(proposal.token_ids)
            self.draft_logprobs = proposal.logprobs
            self.draft_confidences = list(proposal.confidences)

    def record_decode_step(self, num_drafts: int, num_accepted: int, num_emitted: int,
                           confidence_error: float = 0.0) -> None:
        self.confidence_error_sum += confidence_error
        self.num_decode_steps += 1
        self.num_decode_tokens += num_emitted
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def take_delta(self) -> tuple[str, list[int], list[dict] | None]:
        """(text, token ids, logprob entries) added since the previous call, and mark them as
        reported. Costs only what is new, so streaming stays linear in the output length."""
        start = self.num_emitted_tokens
        delta_ids = self.output_token_ids[start:]
        delta_logprobs = self.logprobs[start:] if self.logprobs is not None else None
        self.num_emitted_tokens = len(self.output_token_ids)
        delta_text = self.output_text[self.num_emitted_chars:]
        self.num_emitted_chars = len(self.output_text)
        return delta_text, delta_ids, delta_logprobs

    def reset_for_recompute(self) -> None:
        """After preemption: nothing is cached; prompt + outputs are prefilled again."""
        assert not self.block_table and self.state_slot is None, "free the blocks first"
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING

    def detokenize_last(self, check_stop_strings: bool) -> str | None:
        """Feed the newest token to the detokenizer; returns the stop string it completed, if any."""
        if self.detokenizer is None:
            return None
        self.output_text += self.detokenizer.append(self.output_token_ids[-1:], check_stop=check_stop_strings)
        return self.detokenizer.stop_str

    def finish(self, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        assert status.is_finished
        self.status = status
        self.stop_reason = stop_reason
        self.finished_time = time.time()
        if self.detokenizer is not None:
            self.output_text += self.detokenizer.finish()  # release the held-back tail
