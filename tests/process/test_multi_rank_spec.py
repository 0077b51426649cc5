"""Speculative decoding on a model spread over ranks (docs/architecture.md §8, docs/model.md §3.8).

Every rank runs the DSpark draft forward too (executor/step_fanout.py `prepare_draft`): the draft
layers' attention is split over the lane and their MoE over the EP group, so a follower that skipped
the draft block, or ran other rows, would hang the collectives or change the drafts. The driver
alone samples and verifies.

Against single-rank runs of the same engine (fp32, same prompts of mixed lengths, greedy and seeded):
- the drafts the real draft layers propose at every step (ids and confidences) are the single-rank ones;
- with oracle drafts (the plain continuation, some depths corrupted: long accepted runs and
  rejections at every depth) the tokens are the single-rank speculative ones, and greedy rows are
  exactly the plain greedy tokens;
- ep2 over cp1 is two data-parallel groups: each group drafts its own sequences, padded with
  placeholder rows to the same row count, and the driver gets every row back in order.
"""
from __future__ import annotations

import json
import random

import pytest

from deepinfer import LLM, SamplingParams

from tests.support.processes import alive
from tests.support.spec_runs import oracle_drafts, record_proposals

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=40,
              enforce_eager=True, skip_tokenizer_init=True, dtype="float32")
# three sequences: with ep2 (dp 2) slots 1 and 3 share a group, 2 is alone (one placeholder row)
PROMPTS = [{"prompt_token_ids": [0] + list(range(7, 7 + n))} for n in (3, 9, 14)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
DRAFTS = 3


def _generate(path, monkeypatch, plain_tokens, **kw):
    """(tokens, proposals, spec counters) of one speculative run with oracle drafts."""
    with monkeypatch.context() as m:
        seen = record_proposals(m)
        oracle_drafts(m, PROMPTS, plain_tokens)
        with LLM(path, **ENGINE, num_speculative_tokens=DRAFTS, **kw) as llm:
            ranks = getattr(llm.llm_engine.executor, "ranks", None)   # none on one rank
            pids = [] if ranks is None else list(ranks.pids.values())
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            stats = llm.llm_engine.scheduler.spec_policy.stats.snapshot()
        assert not any(alive(p) for p in pids), "close() left a follower running"
    return [list(o.outputs[0].token_ids) for o in outs], seen, stats


@pytest.fixture(scope="module")
def single_rank(tiny_v41_dir):
    path = str(tiny_v41_dir)
    with LLM(path, **ENGINE) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    with pytest.MonkeyPatch.context() as m:
        spec = _generate(path, m, plain)
    return path, plain, spec


def test_single_rank_reference_accepts_and_rejects(single_rank):
    _, plain, (tokens, seen, stats) = single_rank
    assert tokens[0] == plain[0] and tokens[2] == plain[2]   # greedy: exactly the plain tokens
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # runs accepted and rejected
    assert stats.accepted_at_depth[DRAFTS - 1] > 0
    assert len(seen) >= 6


@pytest.mark.parametrize("sizes", [dict(context_parallel_size=2), dict(expert_parallel_size=2)],
                         ids=["cp2-lanes2", "ep2-dp2"])
def test_drafts_across_ranks_equal_single_rank(single_rank, monkeypatch, sizes):
    path, plain, (want_tokens, want_seen, want_stats) = single_rank
    tokens, seen, stats = _generate(path, monkeypatch, plain, **sizes)
    assert tokens == want_tokens
    assert tokens[0] == plain[0] and tokens[2] == plain[2]
    assert [s[:3] for s in seen] == [s[:3] for s in want_seen]   # the same draft ids, step by step
    for got, want in zip(seen, want_seen):
        assert max(abs(a - b) for a, b in zip(got[3], want[3])) < 1e-4   # and confidences
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (want_stats.num_draft_tokens,
                                                                   want_stats.num_accepted_tokens)


def test_draft_vocabulary_over_a_split_head_equals_single_rank(single_rank, monkeypatch, tmp_path):
    """cp2 splits the LM head by vocabulary: each rank scores the draft vocabulary's ids in its own slice
    and the columns are gathered in rank order (models/draft_vocab.py); the drafts are the single-rank
    ones with the same vocabulary, all of them in it."""
    path, plain, _ = single_rank
    vocab = sorted(random.Random(9).sample(range(129280), 700))
    (tmp_path / "vocab.json").write_text(json.dumps({"token_ids": vocab}))
    kw = dict(speculative_draft_vocab=str(tmp_path / "vocab.json"))
    want_tokens, want_seen, _ = _generate(path, monkeypatch, plain, **kw)
    tokens, seen, _ = _generate(path, monkeypatch, plain, context_parallel_size=2, **kw)
    assert tokens == want_tokens and tokens[0] == plain[0] and tokens[2] == plain[2]
    assert [s[:3] for s in seen] == [s[:3] for s in want_seen]
    drafted = {t for s in seen for t in s[2]}
    assert drafted and drafted <= set(vocab)


def test_follower_killed_in_a_draft_block(tiny_v41_dir, monkeypatch):
    """ep2: rank 1 dies while the driver is about to run its share of a draft block (after a few
    steps of speculation): the block's collectives fail, the step raises RankFailure naming rank 1 at
    once, the requests are aborted with their blocks freed, and no process is left."""
    import os
    import signal
    import time

    from deepinfer.executor.local_ranks import RankFailure
    from deepinfer.worker.model_runner import ModelRunner
    llm = LLM(str(tiny_v41_dir), **ENGINE, num_speculative_tokens=DRAFTS, expert_parallel_size=2)
    worker = llm.llm_engine.worker
    pid = llm.llm_engine.executor.ranks.pids[1]
    real, blocks, killed = ModelRunner.execute_draft, [], []

    def execute_draft(self, prepared):
        blocks.append(1)
        if len(blocks) == 3:
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return real(self, prepared)
    monkeypatch.setattr(ModelRunner, "execute_draft", execute_draft)
    try:
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(blocks) == 3 and time.monotonic() - killed[0] < 10
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.llm_engine.stats().num_used_blocks == 0
    finally:
        llm.close()
    assert not alive(pid)
