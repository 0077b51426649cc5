"""Automatic prefix caching on the real tiny checkpoints: with it on, every greedy token and every
logprob equals the run with it off (V4 and V4.1, plain and compact records, chunked prompts,
preemption, n > 1, speculative decoding); hits are reported; eviction only reclaims idle blocks;
nothing leaks (docs/prefix_caching.md)."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.prefix_cache import block_hashes
from deepinfer.engine_config import EngineConfig
from deepinfer.worker.worker import Worker, build_model

BLOCK = 16  # the tiny models' default block size (lcm of 16 and their ratios)


def _engine(model_dir, model, **kw) -> LLM:
    cfg = ModelConfig.from_pretrained(model_dir)
    ec = EngineConfig(model=str(model_dir), dtype="float32", **kw).resolve(cfg)
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=Worker(cfg, ec, model=model)))


def _load(model_dir):
    cfg = ModelConfig.from_pretrained(model_dir)
    return model_dir, build_model(cfg, str(model_dir), torch.float32, progress=False)


@pytest.fixture(scope="module")
def v41(tiny_v41_dir):
    return _load(tiny_v41_dir)


@pytest.fixture(scope="module")
def v4(tiny_v4_dir):
    return _load(tiny_v4_dir)


def _shared_prompts(prefix_len: int, suffix_lens, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prefix = [0] + torch.randint(3, 128000, (prefix_len - 1,), generator=g).tolist()
    return [{"prompt_token_ids": prefix + torch.randint(3, 128000, (n,), generator=g).tolist()}
            for n in suffix_lens]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def _run(llm: LLM, prompts, params=GREEDY, one_by_one: bool = True):
    """Outputs of `prompts`, each request run after the previous one finished (so later ones can hit)."""
    if not one_by_one:
        return llm.generate(prompts, params, use_tqdm=False)
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def _result(outs):
    """Every completion's tokens and every logprob entry (token -> (logprob, rank))."""
    return [[(list(c.token_ids), [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in c.logprobs])
             for c in o.outputs] for o in outs]


def _assert_close(got, want, temperature: float):
    """Tokens, ranks and top ids exactly; logprobs as logits agreeing to 1e-4. For steps whose chunk
    shapes differ from the uncached run's: the CPU kernels' rounding depends on a step's row count (a
    prompt fed in two chunks differs from one chunk by ~1e-5 in its logits, which is why
    tests/engine/test_engine_model.py compares chunkings by tokens), and a logprob is a logit difference
    divided by the temperature (1e-5 for greedy rows: model_executor/layers/sampler.py)."""
    tol = 1e-4 / max(temperature, 1e-5)
    assert len(got) == len(want)
    for g, w in zip(_result(got), _result(want)):
        for (g_ids, g_lps), (w_ids, w_lps) in zip(g, w, strict=True):
            assert g_ids == w_ids
            for ge, we in zip(g_lps, w_lps, strict=True):
                assert ge.keys() == we.keys()
                for t in ge:
                    assert ge[t][1] == we[t][1]
                    assert abs(ge[t][0] - we[t][0]) <= tol, (ge[t][0], we[t][0])


def _check_clean(llm: LLM):
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_used_state_slots == 0
    assert bm.num_free_blocks == bm.num_usable_blocks


def _compare(model, prompts, params=GREEDY, one_by_one=True, expect_hits=True, exact=True, **kw):
    """The same requests with prefix caching off and on. exact: every hit ends where the uncached run's
    prompt chunk ends too (max_num_batched_tokens divides it), so both runs feed the same step shapes
    and must agree bit for bit."""
    d, m = model
    off = _engine(d, m, enable_prefix_caching=False, **kw)
    on = _engine(d, m, **kw)
    assert on.llm_engine.block_manager.prefix_cache is not None
    want = _run(off, prompts, params, one_by_one)
    got = _run(on, prompts, params, one_by_one)
    if exact:
        assert _result(got) == _result(want)
    else:
        _assert_close(got, want, params.temperature)
    assert all(o.num_cached_tokens == 0 for o in want)
    if expect_hits:
        assert got[0].num_cached_tokens == 0
        assert any(o.num_cached_tokens > 0 for o in got[1:])
    _check_clean(on)
    _check_clean(off)
    return got, on


@pytest.mark.parametrize("mode", ["plain", "compact"])
def test_v41_cached_prefix_equals_uncached(v41, mode):
    # prefixes on and off block boundaries; the third prompt is the first one again (all but its last
    # token cached), the fourth a prefix of it
    prompts = _shared_prompts(40, [5, 11, 5, 0], seed=1)
    prompts[2] = prompts[0]
    got, on = _compare(v41, prompts, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                       kv_cache_mode=mode)
    assert [o.num_cached_tokens for o in got] == [0, 32, 32, 32]
    st = on.llm_engine.stats()
    assert st.prefix_cache_hits == 96
    assert st.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in prompts)


@pytest.mark.parametrize("mode", ["plain", "compact"])
def test_v4_cached_prefix_equals_uncached(v4, mode):
    prompts = _shared_prompts(70, [3, 20, 9], seed=2)
    got, _ = _compare(v4, prompts, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32,
                      kv_cache_mode=mode)
    assert [o.num_cached_tokens for o in got] == [0, 64, 64]


def test_chunked_prompts_block_by_block(v41):
    prompts = _shared_prompts(70, [4, 30, 1], seed=3)
    got, _ = _compare(v41, prompts, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=16)
    assert [o.num_cached_tokens for o in got] == [0, 64, 64]


def test_chunks_off_block_boundaries(v41):
    # a token budget of 21 splits every prompt off block boundaries, so blocks complete in steps that
    # began in an earlier one (their snapshot rows come partly from the ring)
    prompts = _shared_prompts(70, [4, 30, 1], seed=3)
    got, _ = _compare(v41, prompts, exact=False, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=21)
    assert [o.num_cached_tokens for o in got] == [0, 64, 64]


def test_concurrent_requests_and_n_samples_share_a_prompt(v41):
    prompts = _shared_prompts(36, [2, 7, 13, 2], seed=4)
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6, ignore_eos=True, logprobs=1)
    d, m = v41
    kw = dict(max_model_len=96, max_num_seqs=16, max_num_batched_tokens=128)
    off = _engine(d, m, enable_prefix_caching=False, **kw)
    on = _engine(d, m, **kw)
    want = _run(off, prompts, params, one_by_one=False)
    # all at once: the 12 prompts take several steps at this budget, so the later-admitted ones already
    # hit the blocks the first ones computed (and every run shares steps of other shapes: not bit for bit)
    first = _run(on, prompts, params, one_by_one=False)
    assert on.llm_engine.stats().prefix_cache_hits > 0
    again = _run(on, prompts, params, one_by_one=False)   # all of them hit
    _assert_close(first, want, params.temperature)
    _assert_close(again, want, params.temperature)
    assert all(o.num_cached_tokens >= 32 for o in again)
    _check_clean(on)


def test_preemption_with_prefix_caching_gives_same_tokens(v41):
    prompts = _shared_prompts(33, [12, 20, 17, 25, 9, 14], seed=6)
    kw = dict(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=512, num_kv_blocks=10)
    got, on = _compare(v41, prompts, one_by_one=False, expect_hits=False, exact=False, **kw)
    assert on.llm_engine.stats().num_preemptions > 0
    # preempted sequences find their own prompt blocks again when readmitted
    assert on.llm_engine.stats().prefix_cache_hits > 0


def test_speculative_decoding_with_prefix_caching(v41):
    prompts = _shared_prompts(45, [6, 3, 17], seed=7)
    _compare(v41, prompts, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
             num_speculative_tokens=3)


def test_eviction_reclaims_idle_blocks_lru_and_never_held_ones(v41):
    d, m = v41
    # 11 usable blocks of 16 positions: a 40-token prompt + 8 outputs holds 3 blocks
    llm = _engine(d, m, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=128, num_kv_blocks=12)
    bm = llm.llm_engine.block_manager
    pc = bm.prefix_cache
    groups = [_shared_prompts(40, [1], seed=10 + i)[0] for i in range(7)]
    oldest = None
    for i, p in enumerate(groups[:5]):   # each leaves its 2 full prompt blocks cached, idle
        _run(llm, [p])
        if i == 0:
            oldest = block_hashes(p["prompt_token_ids"], BLOCK, 2)
    assert len(pc.match(oldest)) == 2
    assert len(pc.hash_of) == 10 and pc.num_idle == 10 and pc.num_evicted_blocks == 0
    assert bm.num_free_blocks == 11
    _run(llm, [groups[5]])   # 1 never-used block left: two idle ones are reclaimed, the oldest prompt's
    assert pc.num_evicted_blocks == 2
    assert not any(h in pc.block_of for h in oldest), "the least recently used prefix is evicted first"
    assert _run(llm, [groups[0]])[0].num_cached_tokens == 0
    out = _run(llm, [groups[4]])[0]
    assert out.num_cached_tokens == 32
    # a held block is never reclaimed: a request holding its cached prefix keeps it through the others'
    eng = llm.llm_engine
    eng.add_request("held", groups[4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    eng.step()
    held = list(eng.scheduler.running[0].block_table)
    eng.add_request("other", groups[5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        bm.check_invariants()
        if eng.scheduler.running and eng.scheduler.running[0].request_id == "held":
            assert eng.scheduler.running[0].block_table[:2] == held[:2]
    _check_clean(llm)


def test_abort_releases_shared_blocks(v41):
    d, m = v41
    llm = _engine(d, m, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64)
    eng = llm.llm_engine
    prompts = _shared_prompts(48, [3, 5, 7], seed=8)
    _run(llm, prompts[:1])
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    shared = eng.block_manager._refs
    assert max(shared.values()) >= 2, "the cached prefix is held by several sequences at once"
    for i in range(3):
        eng.abort_request(f"r{i}")
        eng.block_manager.check_invariants()
    assert not eng.has_unfinished_requests()
    _check_clean(llm)


def test_prompt_logprobs_requests_compute_their_whole_prompt(v41):
    d, m = v41
    prompts = _shared_prompts(40, [4, 4], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    off = _engine(d, m, enable_prefix_caching=False, max_model_len=64, max_num_seqs=2)
    on = _engine(d, m, max_model_len=64, max_num_seqs=2)
    want = _run(off, prompts, params)
    got = _run(on, prompts, params)
    assert [o.num_cached_tokens for o in got] == [0, 0]
    for a, b in zip(got, want):
        assert [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in a.prompt_logprobs] == \
            [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in b.prompt_logprobs]


def test_option_off_and_graph_runners_disable_it(v41):
    d, m = v41
    llm = _engine(d, m, enable_prefix_caching=False, max_model_len=64, max_num_seqs=2)
    assert llm.llm_engine.block_manager.prefix_cache is None
    assert not llm.llm_engine.worker.cache.swa_snap
    from deepinfer.worker.runners.cuda_graphs import CudaGraphStrategy
    from deepinfer.worker.worker import prefix_caching_supported
    ec = EngineConfig(model=str(d))
    assert ec.enable_prefix_caching
    assert not prefix_caching_supported(ec, CudaGraphStrategy, log=False)
