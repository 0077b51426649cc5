"""Sampling from the CP group's vocabulary candidates (layers/vocab_parallel.py) gives bit for bit what
the Sampler gives on the whole logits rows; which steps may use candidates. In one process: each
rank's slice is cut from one row and the all-gather is a concatenation (the collective itself runs
across processes in tests/process/test_vocab_parallel_ranks.py)."""
import pytest
import torch

from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.distributed.step_codec import KIND_STEP, StepMessage, decode, to_bytes
from deepinfer.executor.step_fanout import FanoutStep, StepFanout
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.model_executor.layers.vocab_parallel import (MAX_CANDIDATES, HeadPlan, VocabShard, head_plan,
                                                            stable_top)
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.step_transport import PreparedStep

V = 1000


def tied_logits(n: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid, so many tokens tie, across slices and at every cut."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 4).round() / 4


def via_candidates(logits: torch.Tensor, plan: HeadPlan, cp: int) -> torch.Tensor:
    """The candidate logits the driver samples from, each rank's part computed from its own slice."""
    per = V // cp
    shards = [VocabShard(r * per, per, V, cp) for r in range(cp)]
    parts = [s.candidates(logits[:, s.start:s.start + per], plan) for s in shards]
    return shards[0].candidate_logits(torch.cat(parts, dim=1), plan)


def same_output(a, b) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    for name in ("logprobs", "token_ranks", "top_ids", "top_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, seed=11),
    SamplingParams(temperature=1.3, top_k=40, seed=12, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1, seed=13),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=MAX_CANDIDATES, seed=14),
]


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_candidates_sample_exactly_as_the_whole_rows(cp, seed):
    logits = tied_logits(len(ROWS), seed)
    bans = [(), (3, 4, 500), (), (int(logits[3].argmax()),), (int(logits[4].argmax()), 999), ()]
    plan = head_plan(ROWS, bans)
    assert plan is not None and plan.count == MAX_CANDIDATES
    batch = lambda: SamplingBatch.build(ROWS, list(range(7, 7 + len(ROWS))), banned_ids_per_row=bans)  # noqa: E731
    same_output(Sampler()(via_candidates(logits, plan, cp), batch()), Sampler()(logits, batch()))


@pytest.mark.parametrize("cp", [2, 4])
def test_logprobs_of_top_k_rows_are_exact(cp):
    rows = [SamplingParams(temperature=t, top_k=k, seed=s, logprobs=lp)
            for t, k, s, lp in ((0.8, 3, 1, 0), (1.1, 20, 2, 5), (0.5, 7, 3, 20), (1.0, 2, 4, None))]
    for seed in range(3):
        logits = tied_logits(len(rows), 100 + seed)
        plan = head_plan(rows)
        batch = SamplingBatch.build(rows, [3, 4, 5, 6])
        a, b = Sampler()(via_candidates(logits, plan, cp), batch), Sampler()(logits, batch)
        assert a.top_ids is not None
        same_output(a, b)


def test_greedy_ties_pick_the_lowest_id_across_slices():
    logits = torch.zeros(2, V)
    logits[0, [740, 260, 999]] = 5.0    # the max in three slices of four
    logits[1, 250:] = 1.0               # every slice but the first ties from its first id
    plan = head_plan([SamplingParams(temperature=0.0)] * 2)
    out = Sampler()(via_candidates(logits, plan, 4), SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [0, 0]))
    assert out.token_ids.tolist() == [260, 250]


def test_stable_top_keeps_the_lowest_ids_of_a_tie_at_the_cut():
    key = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
    assert stable_top(key, 3).tolist() == [[1, 2, 3]]
    assert stable_top(torch.full((1, 4), float("-inf")), 2).tolist() == [[0, 1]]


def test_rows_that_need_the_whole_vocabulary_take_no_plan():
    plain = SamplingParams(temperature=0.8, top_k=10)
    whole = [SamplingParams(temperature=0.8),                           # no top-k
             SamplingParams(temperature=0.8, top_k=10, top_p=0.9),      # top-p sums the vocabulary
             SamplingParams(temperature=0.8, top_k=MAX_CANDIDATES + 1),
             SamplingParams(temperature=0.8, top_k=10, logit_bias={5: 1.0}),
             SamplingParams(temperature=0.8, top_k=10, presence_penalty=0.5),
             SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.2)]
    for p in whole:
        assert head_plan([plain, p]) is None, p
    # greedy rows' logprobs span the vocabulary (T = 1e-5 without top-k); without logprobs one candidate
    assert head_plan([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3, logprobs=2)]) is None
    assert head_plan([SamplingParams(temperature=0.0)]).count == 1
    assert head_plan([plain], scored=True) is None
    assert head_plan([plain], [tuple(range(2000))]) is None   # too many bans for the step message


def test_plan_rows_and_json_round_trip():
    plan = HeadPlan(4, [1.0, 0.5, 0.25], [(0, 7), (2, 9), (2, 11)])
    sub = plan.rows([2, 0])
    assert (sub.temperatures, sub.bans) == ([0.25, 1.0], [(1, 7), (0, 9), (0, 11)])
    assert HeadPlan.from_json(plan.to_json()) == plan


def test_the_plan_goes_out_split_by_data_parallel_group():
    """StepFanout.publish hands each group its rows' plan through the step message (a decoded
    follower reads its own), and keeps the driver's group's share."""
    sent = []

    class Channel:
        def send(self, msg):
            sent.append(decode(to_bytes(msg)))

    fanout = StepFanout(ParallelLayout(rank=0, cp=1, ep=2), None, Channel())
    # rows in chunk order land at gathered rows 0, 2, 1 (stride 2): group 0 holds rows 0 and 2
    prepared = PreparedStep(None, None, 3, FanoutStep(StepMessage(KIND_STEP, [], 2), 2, torch.tensor([0, 2, 1])),
                            HeadPlan(3, [0.5, 1.0, 0.25], [(1, 4), (2, 9)]))
    fanout.publish(prepared)
    groups = [HeadPlan.from_json(h) for h in sent[0].head]
    assert groups == [HeadPlan(3, [0.5, 0.25], [(1, 9)]), HeadPlan(3, [1.0], [(0, 4)])]
    assert prepared.head == groups[0]


def test_a_nan_row_is_a_clear_error():
    key = torch.tensor([[1.0, float("nan"), 2.0]])
    with pytest.raises(ValueError, match="NaN"):
        stable_top(key, 3)
