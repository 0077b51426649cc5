"""LLMEngine outputs: each step's delta is computed once by the engine, deltas concatenate to the
final result, and a running output costs what is new, not the whole request so far."""

from __future__ import annotations

import pytest

from deepinfer.outputs import ListPrefix
from deepinfer.sampling_params import SamplingParams

from tests.support.toy_engine import assert_pool_empty, make_engine, reference_tokens, run_all


def _stream_all(engine):
    """Every output of every request, in order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_deltas_concatenate_to_the_final_output():
    engine = make_engine(max_num_batched_tokens=8)  # chunked prefill: outputs start late
    engine.add_request("lp", [5] * 11, SamplingParams(n=2, seed=1, max_tokens=9, logprobs=2, ignore_eos=True))
    engine.add_request("plain", [6, 7], SamplingParams(seed=2, max_tokens=5, ignore_eos=True))
    seen = _stream_all(engine)
    for rid, outs in seen.items():
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        for c in final.outputs:
            parts = [o.outputs[c.index] for o in outs]
            assert sum((p.delta_token_ids for p in parts), []) == c.token_ids
            assert "".join(p.delta_text for p in parts) == c.text
            if rid == "lp":
                assert sum((p.delta_logprobs for p in parts), []) == c.logprobs and len(c.logprobs) == 9
            else:
                assert all(p.delta_logprobs is None for p in parts) and c.logprobs is None
            # The final output holds plain lists, as LLM.generate returned before.
            assert type(c.token_ids) is list and (c.logprobs is None or type(c.logprobs) is list)
    assert seen["plain"][-1].outputs[0].token_ids == reference_tokens(
        [6, 7], SamplingParams(seed=2, max_tokens=5, ignore_eos=True))
    assert_pool_empty(engine)


def test_a_late_step_output_holds_one_new_token_and_snapshots_stay_true():
    engine = make_engine(max_model_len=200)
    engine.add_request("long", [5, 6], SamplingParams(seed=3, max_tokens=120, logprobs=1, ignore_eos=True))
    outs = _stream_all(engine)["long"]
    assert len(outs) == 120  # one output per decode step
    final = outs[-1].outputs[0]
    for k, out in enumerate(outs[:-1], start=1):
        c = out.outputs[0]
        # What a step builds for its request: one token, one logprob entry, not the k so far.
        assert c.delta_token_ids == [final.token_ids[k - 1]] and len(c.delta_logprobs) == 1
        # The running view is an O(1) snapshot, still true after the request went on.
        assert isinstance(c.token_ids, ListPrefix) and isinstance(c.logprobs, ListPrefix)
        assert c.token_ids == final.token_ids[:k] and len(c.logprobs) == k
        assert c.token_ids[-1] == final.token_ids[k - 1] and c.token_ids[1:3] == final.token_ids[:k][1:3]
    assert outs[-1].prompt_token_ids is outs[0].prompt_token_ids  # not copied per step either


def test_abort_output_carries_the_last_delta():
    engine = make_engine()
    engine.add_request("a", [5, 6], SamplingParams(seed=1, max_tokens=30, ignore_eos=True))
    streamed = []
    for _ in range(3):
        for out in engine.step():
            streamed += out.outputs[0].delta_token_ids
    out = engine.abort_request("a")
    c = out.outputs[0]
    assert c.finish_reason == "abort" and c.delta_token_ids == [] and c.token_ids == streamed
    assert run_all(engine) == {}


def test_list_prefix_behaves_like_the_list_it_shows():
    items = [1, 2, 3, 4]
    view = ListPrefix(items, 3)
    items.append(5)
    assert len(view) == 3 and list(view) == [1, 2, 3] and view == [1, 2, 3] and [1, 2, 3] == view
    assert view != [1, 2, 3, 4] and view[-1] == 3 and view[::-1] == [3, 2, 1] and 4 not in view
    with pytest.raises(IndexError):
        view[3]
