"""Confidence-scheduled verification: how many of its drafts each decode row verifies this step.

Every draft carries a confidence c_j, the draft head's estimate of P(d_j accepted | d_0 .. d_{j-1}
accepted) (models/dspark_draft.confidence). The estimate that draft j of a row is accepted is then
the running product e_j = c_0 * .. * c_j, and a row verifying k drafts emits 1 + (drafts accepted)
tokens, in expectation 1 + e_0 + .. + e_{k-1}.

A step of S decode rows that verifies K drafts in all feeds T = S + K query rows. Verifying the K
drafts with the largest estimates gives the most expected tokens for that T, and e_j never grows with
j, so those K drafts are a prefix of every row's drafts (ties go to the shallower draft). The plan
takes the T that maximises expected tokens / estimated step time(T) (spec/step_times.py), within a
row budget (max_num_batched_tokens).

The head's confidences need not be calibrated (on a checkpoint whose drafts are never accepted they
still predict about one in two), so the plan scales each depth's estimates by how they have fared
(AcceptanceCalibration: accepted / predicted over recently verified drafts, with a prior).

Greedy rows emit exactly their plain greedy tokens whatever they verify (spec/verify.py).
Sampled rows stay distributed as the target, but which draws they make depends on how many drafts
they verify, so a seeded request's tokens then depend on the batch (docs/model.md §6.4).
"""
from __future__ import annotations

from typing import Callable, Sequence


def acceptance_estimates(confidences: Sequence[float]) -> list[float]:
    """e_j = c_0 * .. * c_j, each confidence clamped to [0, 1]."""
    out, e = [], 1.0
    for c in confidences:
        e *= min(max(float(c), 0.0), 1.0)
        out.append(e)
    return out


def calibrated_estimates(confidences: Sequence[float], factors: Sequence[float] = ()) -> list[float]:
    """acceptance_estimates scaled by a per-depth factor (AcceptanceCalibration.factors; 1 past its
    end), capped at 1 and kept non-increasing in depth."""
    out, prev = [], 1.0
    for j, e in enumerate(acceptance_estimates(confidences)):
        f = factors[j] if j < len(factors) else 1.0
        prev = min(prev, e * f, 1.0)
        out.append(prev)
    return out


class AcceptanceCalibration:
    """How far the draft head's estimates are from what verification accepts, per depth.

    factor_j = (accepted_j + PRIOR) / (predicted_j + PRIOR): accepted_j counts verified drafts at
    depth j that were accepted, predicted_j sums their estimates e_j. Both decay by DECAY every
    engine step, so the factor follows the current workload; and when a factor near 0 has stopped
    every verification at a depth, the decay brings it back towards 1 until a few drafts are verified
    again and measured (the plan's own exploration).
    """
    PRIOR = 4.0
    DECAY = 0.98

    def __init__(self):
        self.accepted: list[float] = []
        self.predicted: list[float] = []

    def record(self, num_drafts: int, num_accepted: int, confidences: Sequence[float]) -> None:
        if num_drafts <= 0 or len(confidences) < num_drafts:
            return
        grow = num_drafts - len(self.accepted)
        if grow > 0:
            self.accepted += [0.0] * grow
            self.predicted += [0.0] * grow
        for j, e in enumerate(acceptance_estimates(confidences[:num_drafts])):
            self.predicted[j] += e
            self.accepted[j] += float(j < num_accepted)

    def step(self) -> None:
        self.accepted = [a * self.DECAY for a in self.accepted]
        self.predicted = [p * self.DECAY for p in self.predicted]

    @property
    def factors(self) -> list[float]:
        return [(a + self.PRIOR) / (p + self.PRIOR) for a, p in zip(self.accepted, self.predicted)]


def plan_verification(confidences: Sequence[Sequence[float]], step_time: Callable[[int], float],
                      max_rows: int, factors: Sequence[float] = ()) -> list[int]:
    """Drafts each row verifies (0 .. len(its confidences)), in row order.

    confidences[r]: row r's draft confidences, one per draft it holds. step_time(T): the estimated
    time of a step feeding T query rows (T = rows + verified drafts); it must be positive.
    max_rows: the most query rows the step may feed; with fewer than one per row nothing is verified.
    factors: per-depth calibration of the estimates (calibrated_estimates); none by default.
    """
    num_rows = len(confidences)
    counts = [0] * num_rows
    if num_rows == 0 or max_rows <= num_rows:
        return counts
    pool = []  # (estimate, depth, row)
    for r, conf in enumerate(confidences):
        pool += [(e, j, r) for j, e in enumerate(calibrated_estimates(conf, factors))]
    pool.sort(key=lambda x: (-x[0], x[1], x[2]))
    pool = pool[:max_rows - num_rows]

    best_k, best = 0, _rate(num_rows, step_time(num_rows))
    expected = float(num_rows)
    for k, (e, _, _) in enumerate(pool, start=1):
        if e <= 0.0:
            break  # nothing more to expect; a longer step never pays
        expected += e
        rate = _rate(expected, step_time(num_rows + k))
        if rate > best:  # strict: an equal rate keeps the shorter step
            best_k, best = k, rate
    for _, _, r in pool[:best_k]:
        counts[r] += 1
    return counts


def _rate(expected_tokens: float, seconds: float) -> float:
    if not seconds > 0.0:
        raise ValueError(f"step_time must be positive, got {seconds!r}")
    return expected_tokens / seconds
