"""Step-time model for confidence-scheduled verification (spec/verify_plan.py), measured online.

The engine records the execute time of every decode-only step under (S sequences, T query rows).
Each (S, T) cell keeps its last WINDOW times and is worth their median: a step slowed by something
else on the machine moves no plan (a mean would carry it for many steps). An estimate for (S, T) is
that cell's median when it has one, else a line fixed(S) + slope * T, where
- slope (seconds per query row) is the least-squares slope within groups of equal S, pooled over the
  groups that have at least two distinct T; before there is any, a prior: a query row costs
  PRIOR_ROW_FRACTION of the mean measured step time per sequence (a row of a memory-bound decode
  step is cheap next to reading the weights once);
- fixed(S) is the mean of (time - slope * T) over S's cells; for an S never measured, the nearest
  measured S's, scaled by S / S'; with no measurement at all, 1.0 (only ratios between candidate
  totals of one step matter).
Estimates are made non-decreasing in T within one plan (StepTimes.for_step), so a noisy cell never
makes a longer step look cheaper than a shorter one.
"""
from __future__ import annotations

import statistics
from collections import deque

PRIOR_ROW_FRACTION = 0.02
WINDOW = 9  # recent times a cell keeps


class StepTimes:
    def __init__(self):
        self.cells: dict[tuple[int, int], float] = {}  # (S, T) -> median seconds of its window
        self._windows: dict[tuple[int, int], deque] = {}
        self.num_samples = 0

    def record(self, num_seqs: int, num_rows: int, seconds: float) -> None:
        if num_seqs < 1 or num_rows < num_seqs or not seconds > 0.0:
            return
        key = (int(num_seqs), int(num_rows))
        window = self._windows.setdefault(key, deque(maxlen=WINDOW))
        window.append(float(seconds))
        self.cells[key] = statistics.median(window)
        self.num_samples += 1

    def slope(self) -> float:
        """Seconds per query row (module docstring)."""
        groups: dict[int, list[tuple[int, float]]] = {}
        for (s, t), v in self.cells.items():
            groups.setdefault(s, []).append((t, v))
        num = den = 0.0
        for pts in groups.values():
            if len(pts) < 2:
                continue
            mt = sum(t for t, _ in pts) / len(pts)
            mv = sum(v for _, v in pts) / len(pts)
            num += sum((t - mt) * (v - mv) for t, v in pts)
            den += sum((t - mt) ** 2 for t, _ in pts)
        if den > 0:
            return max(num / den, 0.0)
        if not self.cells:
            return PRIOR_ROW_FRACTION
        per_seq = sum(v / s for (s, _), v in self.cells.items()) / len(self.cells)
        return PRIOR_ROW_FRACTION * per_seq

    def _fixed(self, num_seqs: int, slope: float) -> float:
        own = [v - slope * t for (s, t), v in self.cells.items() if s == num_seqs]
        if own:
            return sum(own) / len(own)
        if not self.cells:
            return 1.0
        near = min({s for s, _ in self.cells}, key=lambda s: (abs(s - num_seqs), s))
        return self._fixed(near, slope) * num_seqs / near

    def estimate(self, num_seqs: int, num_rows: int, slope: float | None = None) -> float:
        cell = self.cells.get((num_seqs, num_rows))
        if cell is not None:
            return cell
        slope = self.slope() if slope is None else slope
        return max(self._fixed(num_seqs, slope) + slope * num_rows, 1e-9)

    def for_step(self, num_seqs: int):
        """step_time(T) for plan_verification: estimates for a step of num_seqs rows, non-decreasing in T."""
        slope = self.slope()
        memo: list[float] = []  # memo[i]: the estimate for num_seqs + i rows

        def step_time(num_rows: int) -> float:
            while len(memo) <= num_rows - num_seqs:  # fill upwards: never cheaper than one row less
                est = self.estimate(num_seqs, num_seqs + len(memo), slope)
                memo.append(max(est, memo[-1]) if memo else est)
            return memo[num_rows - num_seqs] if num_rows >= num_seqs else self.estimate(num_seqs, num_rows, slope)
        return step_time
