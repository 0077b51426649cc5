"""Confidence-scheduled verification: how many of its drafts each decode row verifies this step.

Every draft carries a confidence c_j, the draft head's estimate of P(d_j accepted | d_0 .. d_{j-1}
accepted) (models/dspark_draft.confidence). The estimate that draft j of a row is accepted is then
the running product e_j = c_0 * .. * c_j, and a row verifying k drafts emits 1 + (drafts accepted)
tokens, in expectation 1 + e_0 + .. + e_{k-1}.

A step of S decode rows that verifies K drafts in all feeds T = S + K query rows. Verifying the K
drafts with the largest estimates gives the most expected tokens for that T, and e_j never grows with
j, so those K drafts are a prefix of every row's drafts (ties go to the shallower draft). The plan
takes the T that maximises expected tokens / estimated step time(T) (engine/step_time.py), within a
row budget (max_num_batched_tokens).

Greedy rows emit exactly their plain greedy tokens whatever they verify (layers/spec_verify.py).
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


def plan_verification(confidences: Sequence[Sequence[float]], step_time: Callable[[int], float],
                      max_rows: int) -> list[int]:
    """Drafts each row verifies (0 .. len(its confidences)), in row order.

    confidences[r]: row r's draft confidences, one per draft it holds. step_time(T): the estimated
    time of a step feeding T query rows (T = rows + verified drafts); it must be positive.
    max_rows: the most query rows the step may feed; with fewer than one per row nothing is verified.
    """
    num_rows = len(confidences)
    counts = [0] * num_rows
    if num_rows == 0 or max_rows <= num_rows:
        return counts
    pool = []  # (estimate, depth, row)
    for r, conf in enumerate(confidences):
        pool += [(e, j, r) for j, e in enumerate(acceptance_estimates(conf))]
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
