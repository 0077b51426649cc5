"""Confidence-scheduled verification (spec/verify_plan.py, spec/step_times.py): which drafts a
step verifies for given confidences and step times."""
import pytest

from deepinfer.spec.verify_plan import acceptance_estimates, plan_verification
from deepinfer.spec.step_times import PRIOR_ROW_FRACTION, WINDOW, StepTimes


def linear(fixed, per_row):
    return lambda t: fixed + per_row * t


def test_estimates_are_running_products_clamped():
    assert acceptance_estimates([0.5, 0.5, 2.0, -1.0]) == [0.5, 0.25, 0.25, 0.0]
    assert acceptance_estimates([]) == []


def test_high_confidence_verifies_everything_low_verifies_nothing():
    cheap = linear(1.0, 0.01)
    assert plan_verification([[0.99] * 3, [0.95] * 5], cheap, 100) == [3, 5]
    assert plan_verification([[0.0] * 3, [0.0] * 5], cheap, 100) == [0, 0]
    # a draft that is expected to pay less than it costs is left out
    assert plan_verification([[0.001] * 3], linear(1.0, 0.5), 100) == [0]


def test_drafts_go_to_the_highest_estimates_as_prefixes():
    # each row costs 1 + 0.1 a query row: a draft pays when its estimate beats the rate it dilutes
    confs = [[0.9, 0.9, 0.9], [0.3, 0.9, 0.9], [0.95, 0.1, 0.9]]
    counts = plan_verification(confs, linear(1.0, 0.1), 100)
    # estimates: row0 .9 .81 .73, row1 .3 .27 .24, row2 .95 .095 .086
    assert counts == [3, 0, 1]
    # a draft after a near-zero one is never taken alone: counts are prefixes of each row's drafts
    assert plan_verification([[0.0, 1.0, 1.0]], linear(1.0, 0.0), 100) == [0]


def test_row_budget_and_draft_counts_are_respected():
    confs = [[1.0] * 4, [0.9] * 4, [0.8] * 4]
    free = linear(1.0, 0.0)
    assert plan_verification(confs, free, 3 + 5) == [4, 1, 0]   # 5 slots: the best estimates first
    assert plan_verification(confs, free, 3) == [0, 0, 0]       # one row each, nothing left
    assert plan_verification(confs, free, 2) == [0, 0, 0]       # fewer rows than sequences
    assert plan_verification(confs, free, 1000) == [4, 4, 4]    # never more than a row holds
    assert plan_verification([], free, 10) == []


def test_equal_rates_keep_the_shorter_step():
    # time doubles with one more row: a certain draft exactly pays for itself (2 tokens / 2 s = 1 / 1 s)
    assert plan_verification([[1.0]], lambda t: float(t), 10) == [0]


def test_step_time_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        plan_verification([[0.5]], lambda t: 0.0, 10)


def test_step_times_measured_cells_and_fitted_slope():
    st = StepTimes()
    f = st.for_step(2)
    assert f(2) == pytest.approx(1.0 + PRIOR_ROW_FRACTION * 2)  # nothing measured: the prior
    st.record(2, 2, 0.10)
    st.record(2, 8, 0.40)
    st.record(4, 4, 0.20)
    st.record(4, 12, 0.60)
    assert st.slope() == pytest.approx(0.05)
    f = st.for_step(2)
    assert f(2) == pytest.approx(0.10) and f(8) == pytest.approx(0.40)   # measured cells
    assert f(5) == pytest.approx(0.25)                                   # on the fitted line
    assert st.for_step(3)(3) == pytest.approx(0.15)  # unseen S: the nearest S (2, before 4), scaled
    st.record(2, 8, 0.80)                              # one slow step moves nothing:
    st.record(2, 8, 0.42)                              # the median of the cell's window
    assert st.cells[(2, 8)] == pytest.approx(0.42)
    for _ in range(WINDOW):                            # only recent times count
        st.record(2, 8, 0.2)
    assert st.cells[(2, 8)] == pytest.approx(0.2)
    st.record(0, 0, 1.0)
    st.record(2, 1, 1.0)  # fewer rows than sequences: ignored
    assert (0, 0) not in st.cells and (2, 1) not in st.cells


def test_step_times_never_decrease_within_a_plan():
    st = StepTimes()
    st.record(1, 1, 0.10)
    st.record(1, 3, 0.05)  # a noisy cheap cell
    f = st.for_step(1)
    assert [f(t) for t in (1, 2, 3, 4)] == sorted(f(t) for t in (1, 2, 3, 4))
    assert f(3) >= f(1)


def test_prior_slope_scales_with_measured_steps():
    st = StepTimes()
    st.record(4, 16, 0.4)  # one cell only: no within-S variation
    assert st.slope() == pytest.approx(PRIOR_ROW_FRACTION * 0.1)
    assert st.for_step(4)(4) == pytest.approx(0.4 - PRIOR_ROW_FRACTION * 0.1 * 12)


def _decoding_scheduler(policy, confidences):
    """A Scheduler whose sequences have prefilled and hold 3 drafts each with these confidences."""

    from deepinfer.engine.block_manager import BlockManager
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.engine_config import EngineConfig
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.sequence import Sequence
    from deepinfer.step_result import DraftProposal, RowResult, StepResult

    cfg = EngineConfig(model="x", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                       num_speculative_tokens=3, speculative_verify=policy)
    sched = Scheduler(cfg, BlockManager(64, 4, 5))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(len(confidences)):
        sched.add(Sequence(f"r{i}", i, [0, 5, 6, 7], params, seed=i))
    out = sched.schedule()
    rows = [RowResult(tokens=[(10 + i, None, None, [])], num_accepted=0,
                      proposal=DraftProposal([20, 21, 22], None, c)) for i, c in enumerate(confidences)]
    sched.update(out.scheduled, StepResult(rows))
    return sched


def test_scheduler_rows_carry_only_their_planned_drafts():
    confs = [[0.99, 0.99, 0.99], [0.0, 0.9, 0.9], [0.9, 0.05, 0.9]]
    sched = _decoding_scheduler("confidence", confs)
    sched.spec_policy.step_times.record(3, 3, 1.0)
    sched.spec_policy.step_times.record(3, 12, 1.09)  # 0.01 s a query row
    out = sched.schedule()
    assert [len(s.draft_token_ids) for s in out.scheduled] == [3, 0, 1]
    assert [s.draft_token_ids for s in out.scheduled] == [[20, 21, 22], [], [20]]
    assert [s.num_new_tokens for s in out.scheduled] == [4, 1, 2] and out.num_batched_tokens == 7
    # the row budget caps the drafts: 5 rows = the 3 decodes + the 2 best drafts
    sched = _decoding_scheduler("confidence", confs)
    sched.config.max_num_batched_tokens = 5
    sched.spec_policy.step_times.record(3, 3, 1.0)
    sched.spec_policy.step_times.record(3, 12, 1.09)
    out = sched.schedule()
    assert [len(s.draft_token_ids) for s in out.scheduled] == [2, 0, 0] and out.num_batched_tokens == 5


def test_scheduler_verifies_everything_under_all():
    sched = _decoding_scheduler("all", [[0.0] * 3, [0.5] * 3])
    out = sched.schedule()
    assert [s.draft_token_ids for s in out.scheduled] == [[20, 21, 22]] * 2


def test_calibration_learns_rejections_and_recovers_by_decay():
    from deepinfer.spec.verify_plan import AcceptanceCalibration, calibrated_estimates
    cal = AcceptanceCalibration()
    assert cal.factors == [] and calibrated_estimates([0.5, 0.5], cal.factors) == [0.5, 0.25]
    for _ in range(50):  # confident drafts, never accepted
        cal.record(2, 0, [0.8, 0.8])
        cal.step()
    low = cal.factors
    assert len(low) == 2 and all(f < 0.2 for f in low)
    cheap = linear(1.0, 0.3)  # a query row costs 30 % of a step's fixed part
    assert plan_verification([[0.8, 0.8]], cheap, 10) == [2]           # raw confidences: worth it
    assert plan_verification([[0.8, 0.8]], cheap, 10, low) == [0]      # calibrated: not
    for _ in range(300):  # nothing verified: the evidence fades and drafts get verified again
        cal.step()
    assert plan_verification([[0.8, 0.8]], cheap, 10, cal.factors) == [2]
    for _ in range(20):  # under-confident and accepted: the factor goes above 1
        cal.record(1, 1, [0.5])
    assert cal.factors[0] > 1.5
    # capped at 1, never increasing with depth
    assert calibrated_estimates([0.5, 0.9], [3.0, 0.1]) == pytest.approx([1.0, 0.045])
    assert calibrated_estimates([0.5, 0.9], [1.0, 3.0]) == [0.5, 0.5]
