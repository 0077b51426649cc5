import dataclasses

import pytest

from deepinfer.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


@pytest.mark.parametrize("field,value,needle", [
    ("n", 0, "n must be an integer >= 1"),
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature"),
    ("temperature", float("inf"), "temperature"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be -1 or 0 (disabled) or an integer >= 1"),
    ("top_k", 2.5, "top_k"),
    ("min_p", -0.1, "min_p must be in [0, 1]"),
    ("min_p", 1.1, "min_p"),
    ("max_tokens", 0, "max_tokens must be None or an integer >= 1"),
    ("max_tokens", -5, "max_tokens"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("logprobs", 21, "logprobs must be None or an integer in [0, 20]"),
    ("logprobs", -1, "logprobs"),
    ("seed", -1, "seed must be None or an integer in [0, 2**63)"),
    ("seed", 2**63, "seed"),
    ("seed", True, "seed"),
    ("stop", "", "stop must be None, a non-empty string or a list of non-empty strings"),
    ("stop", ["ok", 3], "stop"),
    ("stop_token_ids", [-1], "stop_token_ids must be None or a list of integers >= 0"),
    ("ignore_eos", 1, "ignore_eos must be a bool"),
])
def test_invalid_values_name_field_and_range(field, value, needle):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert needle in str(exc.value)
    assert isinstance(exc.value, SamplingParamsError) and exc.value.param == field


def test_min_tokens_bounded_by_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100  # None: up to max_model_len
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_accepted_edges():
    SamplingParams(top_p=1.0, top_k=0, min_p=1.0, logprobs=0, seed=0)
    SamplingParams(logprobs=20, seed=2**63 - 1, temperature=0)
    assert SamplingParams(top_k=0).top_k_enabled is False
    assert SamplingParams(top_k=1).top_k_enabled is True


def test_greedy_resets_filters():
    # docs/model.md §6.1: temperature < 1e-5 is greedy; top-p/top-k are reset (and min-p is moot).
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=5, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert p.effective_temperature == 1e-5
    assert SamplingParams(temperature=0.5e-5).is_greedy
    q = SamplingParams(temperature=1e-5, top_k=5)
    assert not q.is_greedy and q.top_k == 5


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    p = SamplingParams(stop=["a", "bcd"], stop_token_ids=(7, 9))
    assert p.stop_strings == ["a", "bcd"] and p.stop_token_ids == [7, 9] and p.max_stop_str_len == 3


def test_replace_revalidates():
    p = SamplingParams(stop="x")
    q = dataclasses.replace(p, stop=["yy"], temperature=0.5)
    assert q.stop_strings == ["yy"] and q.temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)
