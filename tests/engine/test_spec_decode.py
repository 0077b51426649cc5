"""Speculative decoding end to end on the tiny V4.1 checkpoint (LLM.generate -> scheduler -> worker ->
ModelRunner.run -> spec_verify -> DSpark draft forward).

Greedy with drafts emits exactly the plain greedy tokens: with the checkpoint's own (random) draft
layers, which are almost always rejected, and with oracle drafts (the plain run's continuation with
some depths corrupted) that drive long accepted runs, rejections at every depth, stops inside an
accepted run, chunked prompts and preemption. Sampled requests stay reproducible per seed whatever
the batch. Aborts free everything."""
import random

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine_config import EngineConfig
from deepinfer.spec import decoder, proposer
from deepinfer.worker.worker import build_model

from tests.support.spec_runs import oracle_drafts, prompts_of_lengths, spec_llm, token_lists


@pytest.fixture(scope="module")
def v41(tiny_v41_dir):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    return tiny_v41_dir, cfg, build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
LENS = (3, 11, 26, 40)


@pytest.fixture(scope="module")
def plain(v41):
    prompts = prompts_of_lengths(LENS)
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4)
    return prompts, token_lists(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_greedy_with_real_drafts_equals_plain_greedy(v41, plain):
    prompts, want = plain
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    st = llm.llm_engine.stats()
    assert st.spec_decode.num_draft_tokens > 0 and st.num_used_blocks == 0 and st.num_used_state_slots == 0


def test_greedy_with_oracle_drafts_mixed_lengths_chunked_and_preempted(v41, plain, monkeypatch):
    prompts, want = plain
    oracle_drafts(monkeypatch, prompts, want)
    for kw in (dict(max_num_seqs=4),                                   # mixed lengths in one batch
               dict(max_num_seqs=4, max_num_batched_tokens=12),        # chunked prompts, draft rows squeezed
               dict(max_num_seqs=4, num_kv_blocks=9, block_size=16)):  # a pool too small: preemption
        llm = spec_llm(v41, max_model_len=96, num_speculative_tokens=3, **kw)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_lists(outs) == want, kw
        st = llm.llm_engine.stats()
        spec = st.spec_decode
        assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
        assert spec.tokens_per_step > 1.3, spec
        assert len(spec.accept_rates) == 3 and all(0 < r < 1 for r in spec.accept_rates), spec
        assert st.num_used_blocks == 0 and st.num_used_state_slots == 0
        m = outs[2].metrics
        assert m.num_decode_tokens == 13 and m.num_decode_steps < 13 and m.num_accepted_tokens > 0
        if "num_kv_blocks" in kw:
            assert st.num_preemptions > 0


def test_stop_inside_an_accepted_run_truncates_and_max_tokens_holds(v41, plain, monkeypatch):
    prompts, want = plain
    oracle_drafts(monkeypatch, prompts, want, corrupt=0.0)  # every draft right: runs of 4
    stop = want[1][6]
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=[stop])]
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    assert token_lists(outs)[0] == want[0][:9]
    assert outs[0].outputs[0].finish_reason == "length"
    cut = want[1].index(stop) + 1
    assert token_lists(outs)[1] == want[1][:cut] and outs[1].outputs[0].stop_reason == stop
    assert llm.llm_engine.stats().spec_decode.tokens_per_step > 3


def test_sampled_requests_reproduce_per_seed_across_batches(v41):
    prompts = prompts_of_lengths((9, 23, 31), seed=4)
    params = [SamplingParams(temperature=0.8, top_k=40, seed=21 + i, max_tokens=10, ignore_eos=True)
              for i in range(3)]
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    together = token_lists(llm.generate(prompts, params, use_tqdm=False))
    alone = [token_lists(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    assert together == alone and all(len(t) == 10 for t in together)
    tight = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3, num_kv_blocks=7, block_size=16)
    assert token_lists(tight.generate(prompts, params, use_tqdm=False)) == together
    assert tight.llm_engine.stats().num_preemptions > 0


def test_abort_mid_speculation_frees_everything(v41):
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    eng = llm.llm_engine
    for i, p in enumerate(prompts_of_lengths((7, 15))):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert any(s.draft_token_ids for s in eng.scheduler.running)
    for i in range(2):
        assert eng.abort_request(f"r{i}").outputs[0].finish_reason == "abort"
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_used_blocks == 0 and eng.block_manager.num_used_state_slots == 0
    assert not eng.has_unfinished_requests()


def test_speculation_needs_v41_draft_layers(tiny_v4_dir):
    cfg = ModelConfig.from_pretrained(tiny_v4_dir)
    with pytest.raises(ValueError, match="deepseek_v41 checkpoint with DSpark draft layers"):
        EngineConfig(model=str(tiny_v4_dir), num_speculative_tokens=3).resolve(cfg)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model=str(tiny_v4_dir), num_speculative_tokens=-1)


def test_rows_without_drafts_share_the_step_with_verification_rows(v41, plain, monkeypatch):
    """A prompt's last chunk samples with the plain sampler (logprobs included) in a step where another
    row verifies drafts; a request with max_tokens=1 never drafts (its next step could emit nothing)."""
    prompts, want = plain
    oracle_drafts(monkeypatch, prompts, want)
    prompts = [prompts[0], prompts[3]]  # 3 and 40 tokens: the long prompt is chunked while the short one decodes
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=1, logprobs=2)]
    ref = spec_llm(v41, max_model_len=96, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    mixed, execute = [], decoder.SpecDecoder.execute

    def recording(self, scheduled, chunks, plain_samples, scores):
        mixed.append(any(s.draft_token_ids for s in scheduled) and any(s.do_sample and not s.draft_token_ids for s in scheduled))
        return execute(self, scheduled, chunks, plain_samples, scores)
    monkeypatch.setattr(decoder.SpecDecoder, "execute", recording)
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=12, num_speculative_tokens=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_lists(outs) == token_lists(ref) and token_lists(outs)[0] == want[0]
    assert outs[0].metrics.num_accepted_tokens > 0 and outs[1].metrics.num_draft_tokens == 0
    assert any(mixed)  # a step both verified drafts and sampled a row without any
    got, exp = outs[1].outputs[0].logprobs, ref[1].outputs[0].logprobs
    assert len(got) == 1 and [sorted(e) for e in got] == [sorted(e) for e in exp]
    for g, e in zip(got, exp):
        for t in e:
            # the step's batch differs (verification rows beside it): last-bit noise may move the rank
            # of a sampled token that ties others deep in the distribution, never the top entries
            assert abs(g[t].logprob - e[t].logprob) < 1e-4 and (g[t].rank == e[t].rank or e[t].rank > 2)


def _oracle_confidences(monkeypatch, levels=(0.0, 0.4, 1.0)):
    """On top of oracle_drafts: every draft's confidence a fixed draw from `levels` per sequence, position and
    depth, so confidence scheduling truncates some rows, verifies others fully and skips some."""
    oracle = proposer.DraftProposer.propose

    def draft(self, scheduled, results):
        oracle(self, scheduled, results)
        for i, s in enumerate(scheduled):
            prop = results.get(i) and results[i].proposal
            if prop:
                done = s.seq.num_output_tokens + len(results[i].tokens)
                rng = random.Random(s.seq.prompt_len * 7919 + done)
                prop.confidences = [rng.choice(levels) for _ in prop.token_ids]
    monkeypatch.setattr(proposer.DraftProposer, "propose", draft)


def test_confidence_scheduled_greedy_equals_plain_greedy(v41, plain, monkeypatch):
    """speculative_verify="confidence": rows verify 0..B of their drafts, the rest are dropped (never
    committed, never verified later), and greedy still emits the plain greedy tokens, also with chunked
    prompts and preemption."""
    prompts, want = plain
    oracle_drafts(monkeypatch, prompts, want)
    _oracle_confidences(monkeypatch)
    for kw in (dict(max_num_seqs=4), dict(max_num_seqs=4, max_num_batched_tokens=12),
               dict(max_num_seqs=4, num_kv_blocks=9, block_size=16)):
        llm = spec_llm(v41, max_model_len=96, num_speculative_tokens=3, speculative_verify="confidence", **kw)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_lists(outs) == want, kw
        st = llm.llm_engine.stats()
        spec = st.spec_decode
        assert 0 < spec.num_draft_tokens < spec.num_offered_tokens, spec  # some drafts were not verified
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens and spec.tokens_per_step > 1.2, spec
        assert 0 < spec.verified_per_step and 0 < spec.mean_confidence_error < 1, spec
        assert st.num_used_blocks == 0 and st.num_used_state_slots == 0
        m = outs[2].metrics
        assert m.num_decode_tokens == 13 and m.mean_confidence_error is not None
        assert m.drafts_per_decode_step < 3
        if "num_kv_blocks" in kw:
            assert st.num_preemptions > 0
    # the same drafts verified in full: every offered draft is verified
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    spec = llm.llm_engine.stats().spec_decode
    assert spec.num_draft_tokens == spec.num_offered_tokens > 0


def test_confidence_scheduled_sampling_runs_and_frees_everything(v41, monkeypatch):
    _oracle_confidences(monkeypatch, levels=(0.2, 0.9))
    prompts = prompts_of_lengths((9, 23, 31), seed=4)
    params = [SamplingParams(temperature=0.8, top_k=40, seed=21 + i, max_tokens=10, ignore_eos=True)
              for i in range(3)]
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3, speculative_verify="confidence")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(t) == 10 for t in token_lists(outs))
    st = llm.llm_engine.stats()
    assert 0 < st.spec_decode.num_draft_tokens <= st.spec_decode.num_offered_tokens
    assert st.num_used_blocks == 0 and st.num_used_state_slots == 0
