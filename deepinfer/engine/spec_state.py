"""Engine-wide speculative-decoding counters (docs/model.md §3.8, §6.4).

Every decode row of a step is one request-step: it verified n drafts (0 without speculation),
accepted the first k of them and emitted k + 1 tokens, fewer when a stop rule fired inside the run.
Output tokens per decode step = emitted / request-steps (1.0 without drafts); the accept rate at
depth j = rows that accepted draft j / rows that verified a draft j.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_decode_steps: int = 0      # request-steps of decode rows
    num_emitted_tokens: int = 0    # tokens they emitted
    num_draft_tokens: int = 0      # drafts verified
    num_accepted_tokens: int = 0   # drafts accepted
    verified_at_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        self.num_decode_steps += 1
        self.num_emitted_tokens += num_emitted
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.verified_at_depth)
        if grow > 0:
            self.verified_at_depth += [0] * grow
            self.accepted_at_depth += [0] * grow
        for j in range(num_drafts):
            self.verified_at_depth[j] += 1
            self.accepted_at_depth[j] += int(j < num_accepted)

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per decode request-step (1 + mean accepted drafts, before stops)."""
        return self.num_emitted_tokens / self.num_decode_steps if self.num_decode_steps else 0.0

    @property
    def accept_rates(self) -> list[float]:
        return [a / v if v else 0.0 for a, v in zip(self.accepted_at_depth, self.verified_at_depth)]

    @property
    def draft_accept_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_decode_steps, self.num_emitted_tokens, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.verified_at_depth),
                               list(self.accepted_at_depth))
