"""The engine on the real tiny checkpoints: chunking, batching and preemption never change a
request's tokens; greedy output equals transformers' generate; bad input is rejected cleanly."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.worker.worker import Worker, build_model


def _llm(model_dir, model, **kw):
    cfg = ModelConfig.from_pretrained(model_dir)
    ec = EngineConfig(model=str(model_dir), dtype="float32", **kw).resolve(cfg)
    worker = Worker(cfg, ec, model=model)
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))


@pytest.fixture(scope="module")
def v41(tiny_v41_dir):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    return tiny_v41_dir, build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False)


def _prompts(n, lo=5, hi=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [{"prompt_token_ids": [0] + torch.randint(3, 128000, (m - 1,), generator=g).tolist()} for m in lens]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=12, ignore_eos=True)


def test_chunking_and_batching_do_not_change_tokens(v41):
    d, model = v41
    prompts = _prompts(16)
    params = [GREEDY if i % 2 == 0 else SEEDED for i in range(16)]
    roomy = _llm(d, model, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=2048)
    batched = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    assert all(len(t) == 12 for t in batched)
    for i in (0, 1, 7):  # alone, in a batch of 1
        assert _tokens(roomy.generate([prompts[i]], params[i], use_tqdm=False))[0] == batched[i]
    for budget in (16, 37):  # prompts split into chunks of the token budget
        small = _llm(d, model, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=budget)
        assert _tokens(small.generate(prompts, params, use_tqdm=False)) == batched
    e = roomy.llm_engine
    assert e.block_manager.num_used_blocks == 0


def test_preemption_gives_same_tokens_and_frees_everything(v41):
    d, model = v41
    prompts = _prompts(8, 20, 60, seed=3)
    params = [GREEDY if i % 2 else SEEDED for i in range(8)]
    roomy = _llm(d, model, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512)
    want = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    tight = _llm(d, model, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=10)
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    eng = tight.llm_engine
    assert eng.stats().num_preemptions > 0
    assert got == want
    st = eng.stats()
    assert st.num_used_blocks == 0 and st.num_used_state_slots == 0


def test_bad_input_is_rejected_and_engine_keeps_serving(v41):
    d, model = v41
    llm = _llm(d, model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=256)
    eng = llm.llm_engine
    cases = [
        ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), "empty"),
        ({"prompt_token_ids": [0, 129280]}, SamplingParams(max_tokens=4), "vocab"),
        ({"prompt_token_ids": [0] * 65}, SamplingParams(max_tokens=4), "max_model_len"),
    ]
    eng.add_request("ok", {"prompt_token_ids": [0, 5, 6]}, GREEDY)
    for prompt, params, word in cases:
        with pytest.raises(ValueError, match=word):
            eng.add_request(f"bad-{word}", prompt, params)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"] and len(finished[0].outputs[0].token_ids) == 12
    assert eng.stats().num_used_blocks == 0


def test_greedy_generate_equals_transformers(tiny_v4_dense_dir):
    from transformers import AutoModelForCausalLM
    tf = AutoModelForCausalLM.from_pretrained(str(tiny_v4_dense_dir), dtype=torch.float32).eval()
    llm = LLM(model=str(tiny_v4_dense_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
    prompts = ["The quick brown fox", "DeepSeek V4 runs on Trainium because", "1, 2, 3,"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            ref = tf.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
        assert o.outputs[0].token_ids == ref.tolist()


def test_compact_kv_cache_mode_serves_requests(v41):
    d, model = v41
    llm = _llm(d, model, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_mode="compact")
    w = llm.llm_engine.worker
    assert w.cache.swa[0].dtype == torch.uint8
    outs = llm.generate(_prompts(3, seed=5), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert llm.llm_engine.stats().num_used_blocks == 0
    with pytest.raises(ValueError, match="kv_cache_mode"):
        EngineConfig(model=str(d), kv_cache_mode="fp2")
