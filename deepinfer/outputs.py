"""Request results in vLLM's shape: RequestOutput holds one CompletionOutput per sample (n)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token under the processed distribution (docs/model.md §6.1 step 4)."""

    logprob: float
    rank: int | None = None  # 1-based rank in that distribution
    decoded_token: str | None = None


# One dict per output token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


class ListPrefix(SequenceABC):
    """The first `length` items of a list that is only ever appended to: a read-only snapshot of a
    running request's tokens (or logprobs) made in O(1), so producing an output every step does
    not copy the whole list (a stream of N tokens would cost O(N^2)). A sequence never shortens
    its lists (rejected drafts are never appended), which keeps every prefix handed out earlier
    true. Slicing returns a list of just the sliced items.
    """

    __slots__ = ("_items", "_length")

    def __init__(self, items: list, length: int | None = None):
        self._items = items
        self._length = len(items) if length is None else length
        assert 0 <= self._length <= len(items)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._items[j] for j in range(*i.indices(self._length))]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError("ListPrefix index out of range")
        return self._items[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, ListPrefix)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # like list: compares by value, so not hashable

    def __repr__(self) -> str:
        return f"ListPrefix({list(self)!r})"


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence. finish_reason is None while the request is running.

    `text`, `token_ids`, `logprobs`: everything generated so far. On the final output
    (finish_reason set) token_ids / logprobs are plain lists; on a running output they are
    ListPrefix snapshots (read-only, O(1) to make). `text` is a str, shared, never copied.

    `delta_text`, `delta_token_ids`, `delta_logprobs`: what is new since the previous output of
    this request (each output's deltas are new lists of just those items). Streaming reads only
    these: concatenated over all outputs they equal the final text / token_ids / logprobs.
    The text never has to be taken back: a possible stop-string prefix is held until it is
    resolved, and text past a stop string is never released.
    """

    index: int
    text: str
    token_ids: SequenceABC[int]
    cumulative_logprob: float | None = None
    logprobs: SequenceABC[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None  # None when logprobs were not requested

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time() seconds) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Decode steps and what they gave (speculative decoding, summed over the request's samples):
    # tokens per decode step = num_decode_tokens / num_decode_steps; drafts verified / accepted.
    num_decode_steps: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Sum over verified drafts of |accepted - predicted acceptance| (spec/stats.py).
    confidence_error_sum: float = 0.0

    @property
    def tokens_per_decode_step(self) -> float | None:
        return self.num_decode_tokens / self.num_decode_steps if self.num_decode_steps else None

    @property
    def mean_confidence_error(self) -> float | None:
        return self.confidence_error_sum / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def drafts_per_decode_step(self) -> float | None:
        """Drafts verified per decode step (B with speculative_verify="all", fewer when scheduled)."""
        return self.num_draft_tokens / self.num_decode_steps if self.num_decode_steps else None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict, repr=False)  # engine-specific stats (e.g. spec-decode counts)
