"""Prefix caching on one model across ranks: every rank caches its own shards of the blocks the driver
assigns (the step carries the snapshot and restore copies to every rank), and with data-parallel
attention a cached block serves only sequences of the group whose ranks computed it. Tokens equal a
single rank's without caching (logprobs to the summation order of partial outputs, as in
tests/process/test_multi_rank_engine.py)."""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.processes import alive

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=40,
              enforce_eager=True, skip_tokenizer_init=True, dtype="float32")
PREFIX = list(range(100, 140))     # 2 full blocks of 16 shared
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + [11, 12], PREFIX + [13], PREFIX + [7, 8, 9]]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
TOL = 1e-4 / 1e-5   # logits to 1e-4; a greedy row's logprobs are logits / 1e-5 (layers/sampler.py)


def _one_by_one(llm: LLM):
    outs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in PROMPTS]
    return outs, [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in e.items()}
                                                   for e in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_v41_dir):
    with LLM(str(tiny_v41_dir), **ENGINE, enable_prefix_caching=False) as llm:
        return _one_by_one(llm)[1]


@pytest.mark.parametrize("layout, hits", [
    (dict(context_parallel_size=2), [0, 32, 32, 32]),
    # dp = 2 groups: slots are handed out 1, 2, 3, 4 (one request at a time), so requests 1 and 3 run on
    # group 1 and 2 and 4 on group 0: request 2 finds nothing of group 1's, request 4 its group's blocks
    (dict(expert_parallel_size=2), [0, 0, 32, 32]),
])
def test_multi_rank_prefix_hits_equal_single_rank(tiny_v41_dir, reference, layout, hits):
    with LLM(str(tiny_v41_dir), **ENGINE, **layout) as llm:
        pids = list(llm.llm_engine.executor.ranks.pids.values())
        outs, got = _one_by_one(llm)
        assert [o.num_cached_tokens for o in outs] == hits
        for (g_ids, g_lps), (w_ids, w_lps) in zip(got, reference, strict=True):
            assert g_ids == w_ids
            for ge, we in zip(g_lps, w_lps, strict=True):
                assert ge.keys() == we.keys() and all(abs(ge[t] - we[t]) <= TOL for t in we)
        bm = llm.llm_engine.block_manager
        bm.check_invariants()
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    assert not any(alive(p) for p in pids)
