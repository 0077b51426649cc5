"""Engine-wide speculative-decoding counters (docs/model.md §3.8, §6.4).

Every decode row of a step is one request-step: it verified n drafts (0 without speculation),
accepted the first k of them and emitted k + 1 tokens, fewer when a stop rule fired inside the run.
Output tokens per decode step = emitted / request-steps (1.0 without drafts); the accept rate at
depth j = rows that accepted draft j / rows that verified a draft j.

Confidence error (how well the draft head's confidences predict acceptance, what
speculative_verify="confidence" schedules by): per verified draft j, |1[d_j accepted] - e_j| with
e_j = c_0 * .. * c_j its predicted acceptance probability (spec/verify_plan.py); the counters keep
the sum, the mean is per verified draft. Drafts offered = drafts the decode rows held; verified per
step = drafts verified / engine steps with a decode row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.spec.verify_plan import acceptance_estimates


@dataclass
class SpecDecodeStats:
    num_decode_steps: int = 0      # request-steps of decode rows
    num_emitted_tokens: int = 0    # tokens they emitted
    num_draft_tokens: int = 0      # drafts verified
    num_accepted_tokens: int = 0   # drafts accepted
    verified_at_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    num_offered_tokens: int = 0    # drafts the decode rows held (verified or not)
    num_steps: int = 0             # engine steps with at least one decode row
    confidence_error_sum: float = 0.0  # sum over verified drafts of |accepted - predicted|

    def record_step(self) -> None:
        self.num_steps += 1

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int,
               confidences=(), num_offered: int | None = None) -> None:
        """One decode row; confidences: the row's draft confidences (at least num_drafts of them
        for the confidence error, else it is not counted)."""
        self.num_offered_tokens += num_drafts if num_offered is None else num_offered
        self.confidence_error_sum += confidence_error(num_drafts, num_accepted, confidences)
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

    @property
    def mean_confidence_error(self) -> float:
        """Mean |accepted - predicted acceptance| per verified draft (module docstring)."""
        return self.confidence_error_sum / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def verified_per_step(self) -> float:
        """Drafts verified per engine step with decode rows."""
        return self.num_draft_tokens / self.num_steps if self.num_steps else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_decode_steps, self.num_emitted_tokens, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.verified_at_depth),
                               list(self.accepted_at_depth), self.num_offered_tokens, self.num_steps,
                               self.confidence_error_sum)


def confidence_error(num_drafts: int, num_accepted: int, confidences) -> float:
    """Sum over the first num_drafts drafts of |1[j < num_accepted] - e_j| (0 without confidences)."""
    if num_drafts <= 0 or len(confidences) < num_drafts:
        return 0.0
    est = acceptance_estimates(confidences[:num_drafts])
    return sum(abs(float(j < num_accepted) - e) for j, e in enumerate(est))
