"""tests/support/near_ties.py, the rule the cross-CPU comparisons rely on: a flip is excused only at a
near-tie of the reference and only a few times, and the sampler margin is the production sampler's."""
import pytest
import torch

from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.sampling_params import SamplingParams

from tests.support.near_ties import NearTies, flip_margin, topk_margin


def test_a_flip_is_excused_only_below_the_threshold_and_only_a_few_times():
    ties = NearTies("x", threshold=1e-3, max_excused=2)
    ties.excuse("a", 5e-4)
    with pytest.raises(AssertionError, match="not a rounding flip"):
        ties.excuse("b", 2e-3)
    ties.excuse("c", 0.0)
    with pytest.raises(AssertionError, match="more than 2"):
        ties.excuse("d", 1e-4)


def test_topk_margin_is_the_relative_gap_at_the_kth_score():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0], [1.0, 1.0, float("-inf"), float("-inf")]])
    m = topk_margin(scores, 2)
    assert m[0].item() == pytest.approx(1.0 / 4.0)
    assert m[1].item() == float("inf")   # nothing finite was left out


def test_sampler_margin_is_the_top2_gap_for_greedy_and_finite_for_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [0.5, 0.4, 0.3, 0.2]])
    batch = SamplingBatch.build([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)], [3, 3])
    sampler = Sampler()
    tokens = sampler.forward(logits, batch).token_ids
    assert int(tokens[0]) == 1
    greedy = flip_margin(sampler, logits, batch, tokens, 0, limit=1.0)
    assert 0.1 <= greedy < 0.2    # the ladder's first drop past the 0.1 gap
    assert flip_margin(sampler, logits, batch, tokens, 0, limit=0.05) == float("inf")
    assert 0 < flip_margin(sampler, logits, batch, tokens, 1, limit=64.0) <= 64.0
