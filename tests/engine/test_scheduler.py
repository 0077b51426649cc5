"""Scheduler / engine logic against a toy worker (no real model).

The toy model (tests/support/toy_engine.py) makes a sampled token depend only on the sequence's
token ids and position -- if the cache bookkeeping is right -- which is what makes chunking /
batching / preemption invariance testable here.
"""

from __future__ import annotations

import pytest

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine_config import EngineConfig
from deepinfer.entrypoints.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import SequenceStatus
from deepinfer.step_result import StepResult, sampled_rows

from tests.support.toy_engine import (EOS, VOCAB, ToySamplerOutput, ToyWorker, assert_pool_empty, make_engine,
                                      make_seq, reference_tokens, run_all, text_engine)


def _prompts(k, base_len=5, stride=7):
    return [[(3 + 5 * i + j) % (VOCAB - 3) + 3 for j in range(base_len + stride * i % 23)] for i in range(k)]


# ---- scheduler policy --------------------------------------------------------------------------

def _sched(num_blocks=64, block_size=4, slots=9, **cfg):
    cfg.setdefault("max_model_len", 64)
    config = EngineConfig(model="toy", **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size, slots), eos_token_ids=[EOS])


def _fake_update(sched, out, token=7):
    n = sum(s.do_sample for s in out.scheduled)
    return sched.update(out.scheduled, StepResult(sampled_rows(ToySamplerOutput([token] * n, [0.0] * n))))


def test_chunked_prefill_splits_long_prompt_and_samples_only_at_the_end():
    sched = _sched(max_num_seqs=4, max_num_batched_tokens=8)
    seq = make_seq(0, 20)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        chunks.append([(s.num_new_tokens, s.do_sample) for s in out.scheduled])
        _fake_update(sched, out)
    assert chunks == [[(8, False)], [(8, False)], [(4, True)]]
    assert seq.num_computed_tokens == 20 and seq.output_token_ids == [7]
    out = sched.schedule()  # now a decode
    assert [(s.num_new_tokens, s.do_sample, s.is_decode) for s in out.scheduled] == [(1, True, True)]


def test_decodes_go_first_then_running_prefill_then_waiting_under_the_budget():
    sched = _sched(max_num_seqs=4, max_num_batched_tokens=10)
    a, b, c = make_seq(0, 3), make_seq(1, 30), make_seq(2, 4)
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()  # a whole (3), b chunk (7)
    assert [(s.seq.seq_id, s.num_new_tokens, s.do_sample) for s in out.scheduled] == [(0, 3, True), (1, 7, False)]
    _fake_update(sched, out)
    sched.add(c)
    out = sched.schedule()  # a decodes, b continues with the rest of the budget, c must wait
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 9)]
    assert out.scheduled[0].is_decode and not out.scheduled[1].is_decode
    assert list(sched.waiting) == [c]


def test_max_num_seqs_caps_running():
    sched = _sched(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(i, 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1] and len(sched.waiting) == 2


def test_preemption_evicts_latest_arrival_and_requeues_it_first():
    # 4 usable blocks of 4 positions; two sequences of 6 prompt tokens hold 2 blocks each.
    sched = _sched(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=16)
    seqs = [make_seq(i, 6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]  # max_num_seqs=2: seq 2 waits
    _fake_update(sched, out)
    for _ in range(2):  # decode both until 8 positions are computed: 2 full blocks, empty pool
        _fake_update(sched, sched.schedule())
    assert [s.num_computed_tokens for s in seqs[:2]] == [8, 8] and sched.block_manager.num_free_blocks == 0
    out = sched.schedule()
    # seq 0 needs a third block; seq 1 is the latest arrival -> preempted, its blocks go to seq 0.
    assert [s.seq.seq_id for s in out.scheduled] == [0] and out.preempted == [seqs[1]]
    assert seqs[1].status == SequenceStatus.WAITING and seqs[1].num_computed_tokens == 0
    assert seqs[1].block_table == [] and seqs[1].state_slot is None
    assert list(sched.waiting) == [seqs[1], seqs[2]]  # front of the queue
    assert seqs[1].output_token_ids == [7, 7, 7]  # generated tokens are kept for recompute
    assert len(seqs[0].block_table) == 3 and sched.block_manager.num_free_blocks == 1
    sched.block_manager.check_invariants()
    _fake_update(sched, out)
    out = sched.schedule()  # no preemption now: seq 1 comes back with a chunk of what fits
    assert [(s.seq.seq_id, s.num_new_tokens, s.do_sample) for s in out.scheduled] == [(0, 1, True), (1, 4, False)]


def test_prefill_chunk_shrinks_to_free_blocks_then_yields_to_older_sequence():
    # 4 usable blocks of 4 positions.
    sched = _sched(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=16)
    a, b = make_seq(0, 6), make_seq(1, 11)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes 2 blocks; b's chunk shrinks from 11 to the 8 positions the 2 free blocks hold.
    assert [(s.seq.seq_id, s.num_new_tokens, s.do_sample) for s in out.scheduled] == [(0, 6, True), (1, 8, False)]
    _fake_update(sched, out)
    out = sched.schedule()
    # a decodes inside its blocks; b cannot grow and is the latest arrival: it steps back.
    assert [s.seq.seq_id for s in out.scheduled] == [0] and out.preempted == [b]
    assert b.num_computed_tokens == 0 and sched.block_manager.num_used_blocks == 2
    sched.block_manager.check_invariants()


def test_abort_frees_waiting_and_running():
    sched = _sched(max_num_seqs=1, max_num_batched_tokens=16)
    a, b = make_seq(0, 5), make_seq(1, 5)
    sched.add(a)
    sched.add(b)
    _fake_update(sched, sched.schedule())
    assert sched.block_manager.num_used_blocks == 2
    assert sched.abort("r0") == [a] and sched.abort("r1") == [b]
    assert sched.abort("nope") == []
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0
    sched.block_manager.check_invariants()


# ---- engine ------------------------------------------------------------------------------------

def _run_batch(prompts, params, **cfg):
    engine = make_engine(**cfg)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    finals = run_all(engine)
    assert_pool_empty(engine)
    return engine, [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def test_chunking_batching_and_preemption_do_not_change_tokens():
    prompts = _prompts(6)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12 + i, ignore_eos=True) for i in range(6)]
    params[2] = SamplingParams(temperature=0.7, seed=1234, max_tokens=20, ignore_eos=True)
    expected = [reference_tokens(p, sp) for p, sp in zip(prompts, params)]
    assert [len(t) for t in expected] == [12, 13, 20, 15, 16, 17]

    engine, got = _run_batch(prompts, params, worker=ToyWorker(num_kv_blocks=256), max_num_batched_tokens=256)
    assert got == expected

    engine, got = _run_batch(prompts, params, worker=ToyWorker(num_kv_blocks=256),
                             max_num_batched_tokens=8, max_num_seqs=3)
    assert got == expected
    chunks = [b for batch in engine.worker.batches for b in batch if b[2] > 1]
    assert any(not do_sample for (_, _, _, do_sample) in chunks)  # prompts were split

    # 17 usable blocks x 4 = 68 positions for six sequences of up to 45 tokens: must preempt.
    engine, got = _run_batch(prompts, params, worker=ToyWorker(num_kv_blocks=18),
                             max_num_batched_tokens=16, max_num_seqs=6)
    assert got == expected
    assert engine.stats().num_preemptions > 0


def test_unseeded_requests_are_reproducible_and_distinct():
    prompts = [[5, 6, 7]] * 3
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * 3
    _, first = _run_batch(prompts, params)
    _, again = _run_batch(prompts, params, max_num_batched_tokens=8, max_num_seqs=2)
    assert first == again
    assert len({tuple(t) for t in first}) == 3  # same prompt, different derived seeds
    _, other_seed = _run_batch(prompts, params, seed=7)
    assert other_seed != first


def test_n_sequences_use_seed_plus_index():
    engine = make_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(n=3, seed=40, max_tokens=6, ignore_eos=True))
    out = run_all(engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        assert c.token_ids == reference_tokens([5, 6, 7], SamplingParams(seed=40 + i, max_tokens=6, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_pool_empty(engine)


def test_stop_conditions():
    prompt = [5, 6, 7, 8]
    ref = reference_tokens(prompt, SamplingParams(seed=3, max_tokens=20, ignore_eos=True))

    def final(sp, **cfg):
        engine = make_engine(**cfg)
        engine.add_request("r", prompt, sp)
        out = run_all(engine)["r"].outputs[0]
        assert_pool_empty(engine)
        return out

    out = final(SamplingParams(seed=3, max_tokens=5, ignore_eos=True))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref[:5], "length", None)

    stop_tok = ref[6]
    k = ref.index(stop_tok)
    out = final(SamplingParams(seed=3, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref[:k + 1], "stop", stop_tok)

    out = final(SamplingParams(seed=3, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=k + 2, ignore_eos=True))
    assert len(out.token_ids) > k + 1 and out.token_ids[:k + 1] == ref[:k + 1]

    out = final(SamplingParams(seed=3, max_tokens=None, ignore_eos=True), max_model_len=10)
    assert (out.token_ids, out.finish_reason) == (ref[:6], "length")  # 4 prompt + 6 = max_model_len

    # EOS: the toy model emits EOS only when avoid_eos is off; stop at the first one unless ignore_eos.
    engine = make_engine(ToyWorker(avoid_eos=False), max_model_len=200)
    for i in range(20):
        engine.add_request(str(i), [5, i + 3], SamplingParams(seed=i, max_tokens=150))
    finals = run_all(engine)
    stopped = [o.outputs[0] for o in finals.values() if o.outputs[0].finish_reason == "stop"]
    assert stopped, "some toy stream should hit EOS within 150 tokens"
    for c in stopped:
        assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1] and c.stop_reason is None
    assert_pool_empty(engine)


def test_logprobs_and_streaming_deltas():
    engine = make_engine()
    engine.add_request("lp", [5, 6, 7], SamplingParams(seed=1, max_tokens=4, logprobs=2, ignore_eos=True))
    engine.add_request("plain", [5, 6, 7], SamplingParams(seed=1, max_tokens=4, ignore_eos=True))
    deltas = {"lp": [], "plain": []}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            d = c.delta_token_ids
            deltas[out.request_id] += d
            assert c.token_ids[-len(d):] == d
            if out.finished:
                finals[out.request_id] = out
    for rid, out in finals.items():
        assert deltas[rid] == out.outputs[0].token_ids
    lp, plain = finals["lp"].outputs[0], finals["plain"].outputs[0]
    assert plain.logprobs is None and lp.token_ids == plain.token_ids
    assert len(lp.logprobs) == 4
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert entry[tok].logprob == -(tok % 7) / 4 and entry[tok].rank == 1 + tok % 3
        assert entry[(tok + 1) % VOCAB].rank == 2 and len(entry) == 2  # top-2: tok and tok+1
    assert lp.cumulative_logprob == pytest.approx(sum(-(t % 7) / 4 for t in lp.token_ids))
    m = finals["lp"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_abort_frees_blocks_and_others_keep_running():
    engine = make_engine()
    engine.add_request("a", [5] * 20, SamplingParams(seed=1, max_tokens=30, ignore_eos=True))
    engine.add_request("b", [6] * 10, SamplingParams(seed=2, max_tokens=8, ignore_eos=True))
    engine.add_request("c", [7] * 10, SamplingParams(seed=3, max_tokens=8, ignore_eos=True), )
    engine.step()
    engine.step()
    used = engine.block_manager.num_used_blocks
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert engine.block_manager.num_used_blocks == used - 6  # 22 positions / 4 per block
    assert engine.abort_request("a") is None and engine.abort_request("unknown") is None
    finals = run_all(engine)
    assert set(finals) == {"b", "c"}
    assert finals["b"].outputs[0].token_ids == reference_tokens([6] * 10, SamplingParams(seed=2, max_tokens=8, ignore_eos=True))
    assert_pool_empty(engine)
    engine.add_request("a", [5, 5], SamplingParams(max_tokens=2))  # the id is free again
    run_all(engine)
    assert_pool_empty(engine)


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ([5, VOCAB], "out of vocabulary"),
    ([-1, 5], "out of vocabulary"),
    ([5, 6.0], "int"),
    ([5] * 64, "max_model_len"),
    (3.5, "prompt must be"),
    ({"text": "hi"}, "prompt_token_ids"),
])
def test_bad_input_raises_and_engine_keeps_serving(prompt, match):
    engine = make_engine()
    engine.add_request("ok", [5, 6], SamplingParams(seed=1, max_tokens=3, ignore_eos=True))
    before = engine.stats()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request("bad2", [5], {"max_tokens": 3})
    assert engine.stats() == before and set(engine.requests) == {"ok"}
    finals = run_all(engine)
    assert finals["ok"].outputs[0].token_ids == reference_tokens([5, 6], SamplingParams(seed=1, max_tokens=3, ignore_eos=True))
    assert_pool_empty(engine)


def test_stats_and_step_timing():
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=4)
    timings = []
    engine.timing_hook = timings.append
    for i in range(3):
        engine.add_request(str(i), [5] * 10, SamplingParams(seed=i, max_tokens=5, ignore_eos=True))
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (1, 2)  # 8-token budget: one chunk of the first prompt
    assert s.num_used_blocks == 2 and s.num_free_blocks == 61
    run_all(engine)
    s = engine.stats()
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_finished_requests) == (30, 15, 3)
    assert sum(t.num_prefill_tokens for t in timings) == 30
    assert sum(t.num_decode_tokens for t in timings) + 3 == 15  # the first token comes from prefill
    assert all(t.execute_s >= 0 and t.total_s >= t.execute_s for t in timings)
    assert timings[-1] is engine.last_step_timing


def test_pool_too_small_for_max_model_len_is_rejected():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        make_engine(ToyWorker(num_kv_blocks=16), max_model_len=64)  # 15 x 4 = 60 < 64


def test_llm_generate_orders_results_and_validates():
    llm = LLM.from_engine(make_engine(max_num_batched_tokens=8, max_num_seqs=2))
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    params = [SamplingParams(seed=i, max_tokens=3 + i, ignore_eos=True) for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 4, 5, 6]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    one = llm.generate(prompts[1], params[1], use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="sampling_params list"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([prompts[0], {"prompt_token_ids": [VOCAB]}], use_tqdm=False)
    assert_pool_empty(llm.llm_engine)  # the rejected call left nothing behind
    assert llm.generate([5, 6], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


# ---- text: real tokenizer, toy model ----------------------------------------------------------

def _stream(engine, rid, prompt, sp):
    engine.add_request(rid, prompt, sp)
    text, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            text += c.delta_text
            assert c.text == text  # cumulative text == concatenated deltas, at every step
            final = out
    assert_pool_empty(engine)
    return final


def test_text_prompts_detokenization_and_stop_strings(tokenizer):
    engine = text_engine(tokenizer)
    ref = _stream(engine, "a", "The cat", SamplingParams(seed=5, max_tokens=24))
    assert ref.prompt == "The cat" and ref.prompt_token_ids == tokenizer.encode("The cat")
    ref_text = ref.outputs[0].text
    assert ref_text == tokenizer.decode(ref.outputs[0].token_ids) and len(ref_text) > 40

    stop = ref_text[17:25]  # spans token boundaries
    cut = ref_text.find(stop)
    out = _stream(engine, "b", "The cat", SamplingParams(seed=5, max_tokens=24, stop=[stop, "zzz"])).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (ref_text[:cut], "stop", stop)
    assert out.token_ids == ref.outputs[0].token_ids[:len(out.token_ids)]
    assert len(tokenizer.decode(out.token_ids)) >= cut + len(stop)  # stopped on the completing token

    out = _stream(engine, "c", "The cat", SamplingParams(seed=5, max_tokens=24, stop=stop,
                                                         include_stop_str_in_output=True)).outputs[0]
    assert out.text == ref_text[:cut + len(stop)]

    # A stop string that never completes: the held-back tail is released at the end.
    out = _stream(engine, "d", "The cat", SamplingParams(seed=5, max_tokens=24, stop=[ref_text[-3:] + "#"])).outputs[0]
    assert out.text == ref_text and out.finish_reason == "length"


def test_empty_text_prompt_and_stop_strings_without_tokenizer(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        text_engine(tokenizer).add_request("e", "", SamplingParams())
    engine = make_engine()
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("t", "hello", SamplingParams())
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request("s", [5, 6], SamplingParams(stop="x"))
    assert not engine.requests


