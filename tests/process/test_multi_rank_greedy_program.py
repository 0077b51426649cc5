"""Greedy speculative steps as one device program on a model spread over ranks (spec/greedy_step.py,
executor/step_fanout.py `prepare_greedy_spec`, `prepare_draft(greedy=True)`).

Neuron host mode (region graphs), tiny V4.1, greedy rows with oracle drafts (the plain continuation,
some depths corrupted: accepted runs and rejections): over cp 2 (two lanes, the LM head split by
vocabulary: the acceptance's argmax reads the slices gathered in the graph) and ep 2 (two data-parallel
groups holding 2 and 1 sequences, the single one stopping early: each group gets its share of the
plan, padded to the same block rows, an empty group placeholders only, and the driver reads every row
back in plan order), every speculative decode step runs as one program
on every rank, with one copy each way and no eager op on the driver, and the tokens are the plain
single-rank greedy tokens; the drafts after the prompt (argmax heads in the draft block's program on
every rank) are the single-rank ones.
"""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.neuron_ops.op_census import EAGER_OPS_TARGET, OpCensus
from deepinfer.platforms import reset_platform
from deepinfer.spec import proposer

from tests.support.processes import alive
from tests.support.spec_runs import oracle_drafts

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, skip_tokenizer_init=True,
              dtype="float32")
PROMPTS = [{"prompt_token_ids": [0] + list(range(7, 7 + n))} for n in (3, 9, 14)]
# the middle sequence (alone in its group at ep 2) stops early: its group then verifies no row at all
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 3, 10)]
DRAFTS = 3


def _first_drafts(monkeypatch) -> dict:
    """prompt length -> the drafts the model proposed after its prompt (before the oracle replaces them)."""
    seen = {}
    real = proposer.DraftProposer.propose

    def propose(self, scheduled, results):
        real(self, scheduled, results)
        for i, s in enumerate(scheduled):
            prop = results.get(i) and results[i].proposal
            if prop and s.seq.num_output_tokens == 0:
                seen[s.seq.prompt_len] = list(prop.token_ids)
    monkeypatch.setattr(proposer.DraftProposer, "propose", propose)
    return seen


def _run(path, monkeypatch, plain, **sizes):
    """(tokens, first drafts, spec stats, the driver's census steps) of one speculative run."""
    with monkeypatch.context() as m:
        # the driver resolves its platform once per process (platforms.current_platform): forget it, so
        # the driver and its followers (fresh processes) both build the Neuron host-mode model
        m.setenv("DEEPINFER_ACCELERATOR", "neuron")
        reset_platform()
        first = _first_drafts(m)
        oracle_drafts(m, PROMPTS, plain)
        with LLM(path, **ENGINE, num_speculative_tokens=DRAFTS, **sizes) as llm:
            ranks = getattr(llm.llm_engine.executor, "ranks", None)
            pids = [] if ranks is None else list(ranks.pids.values())
            strategy = llm.llm_engine.worker.runner.strategy
            strategy.census = OpCensus()
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            stats = llm.llm_engine.stats().spec_decode
            steps = list(strategy.census.steps)
        assert not any(alive(p) for p in pids), "close() left a follower running"
    reset_platform()
    return [list(o.outputs[0].token_ids) for o in outs], first, stats, steps


@pytest.fixture(scope="module")
def reference(tiny_v41_dir):
    path = str(tiny_v41_dir)
    with LLM(path, **ENGINE, enforce_eager=True) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with pytest.MonkeyPatch.context() as m:
        one = _run(path, m, plain)
    return path, plain, one


@pytest.mark.parametrize("sizes", [dict(context_parallel_size=2), dict(expert_parallel_size=2)],
                         ids=["cp2-vocab-split", "ep2-dp2"])
def test_greedy_program_over_ranks(reference, monkeypatch, sizes):
    path, plain, (one_tokens, one_first, one_stats, _) = reference
    assert one_tokens == plain
    tokens, first, stats, steps = _run(path, monkeypatch, plain, **sizes)
    assert tokens == plain
    assert first == one_first and len(first) == len(PROMPTS)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (one_stats.num_draft_tokens,
                                                                   one_stats.num_accepted_tokens)
    fused = [s for s in steps if s.label.startswith("verify_draft")]
    assert len(fused) >= 3, [s.label for s in steps]
    for s in fused:
        assert (s.host_to_device, s.device_to_host) == (1, 1) and s.num_eager_ops <= EAGER_OPS_TARGET, s.to_dict()
    # no step verified on the host, and the drafts after the prompt came back as drafts, not logits rows
    assert not [s.label for s in steps if s.label.startswith("verify ")]
    assert all("heads" not in s.phases for s in steps), [s.to_dict() for s in steps]
