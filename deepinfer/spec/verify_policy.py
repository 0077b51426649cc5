"""The scheduler's side of speculative decoding: which drafts each row verifies this step, and what
verification has taught so far (docs/model.md §6.4).

engine/scheduler.py asks `plan` for its decode rows and `fit_prompt_chunk` for a prompt chunk that
reaches a sequence's last token, and reports every decode row's outcome to `record_row`; the engine
feeds `step_times` with the execute time of every decode-only step. Under speculative_verify="all"
a decode row verifies every draft it holds; under "confidence" spec/verify_plan.py picks the drafts
from their confidences (calibrated by `calibration`) and the step-time model (spec/step_times.py).
"""
from __future__ import annotations

from deepinfer.spec.stats import SpecDecodeStats, confidence_error
from deepinfer.spec.step_times import StepTimes
from deepinfer.spec.verify_plan import AcceptanceCalibration, plan_verification


class VerifyPolicy:
    def __init__(self, speculative_verify: str):
        """speculative_verify: engine_config.speculative_verify ("all" or "confidence")."""
        self.mode = speculative_verify
        self.step_times = StepTimes()                # decode-only step times, recorded by the engine
        self.calibration = AcceptanceCalibration()   # what verified drafts' estimates were worth
        self.stats = SpecDecodeStats()               # engine-wide counters (EngineStats.spec_decode)

    def plan(self, decodes, budget: int) -> dict[int, int]:
        """seq_id -> drafts its decode row verifies this step, for the step's decode rows (Sequences)
        within `budget` query rows."""
        if self.mode != "confidence":
            return {s.seq_id: len(s.draft_token_ids) for s in decodes}
        rows = [s for s in decodes if s.draft_token_ids]
        if not rows:
            return {}
        # Every decode row takes a query row; the plan covers those with drafts.
        others = len(decodes) - len(rows)
        step_time = self.step_times.for_step(len(decodes))
        counts = plan_verification([s.draft_confidences[:len(s.draft_token_ids)] for s in rows],
                                   lambda t: step_time(t + others), budget - others,
                                   self.calibration.factors)
        return {s.seq_id: k for s, k in zip(rows, counts)}

    @staticmethod
    def fit_prompt_chunk(seq, want: int, room: int) -> tuple[int, list[int]]:
        """(tokens, drafts) of a prompt chunk of `want` tokens, with `room` tokens the step and the
        pool still hold for it. A chunk that reaches the sequence's last token (the last chunk of a
        recomputed prefill) verifies all of its drafts, so that preemption changes no draw; when they
        do not fit, the chunk stops one token short and the last token goes with its drafts next step.
        A lone last token that still cannot take them goes without (the pool is full and prompt chunks
        never evict: waiting could stall every row); only then can a sampled request's tokens differ
        from an unpreempted run."""
        n = len(seq.draft_token_ids)
        if not n or seq.num_computed_tokens + want != len(seq):
            return want, []
        if want + n <= room:
            return want, list(seq.draft_token_ids)
        return (want - 1, []) if want > 1 else (want, [])

    def record_row(self, seq, num_verified: int, num_accepted: int, num_emitted: int) -> None:
        """One decode row's outcome, before seq's drafts are replaced by the next proposal."""
        confidences = seq.draft_confidences
        self.calibration.record(num_verified, num_accepted, confidences)
        seq.record_decode_step(num_verified, num_accepted, num_emitted,
                               confidence_error(num_verified, num_accepted, confidences))
        self.stats.record(num_verified, num_accepted, num_emitted, confidences,
                          num_offered=len(seq.draft_token_ids))

    def record_step(self) -> None:
        """After a step with a decode row."""
        self.calibration.step()
        self.stats.record_step()
