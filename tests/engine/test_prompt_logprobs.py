"""Prompt logprobs through the engine: equal to the engine's own teacher-forced log-softmax (whole
prompt in one forward) under any chunking and after preemption, and to transformers' on the tiny V4
dense checkpoint within 1e-4 in fp32."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.model_executor.layers.token_scores import score_tokens
from deepinfer.sampling_params import SamplingParamsError
from deepinfer.worker.worker import Worker, build_model
from tests.support.model_helpers import run_chunks

K = 3


@pytest.fixture(scope="module")
def v4(tiny_v4_dense_dir):
    cfg = ModelConfig.from_pretrained(tiny_v4_dense_dir)
    return tiny_v4_dense_dir, cfg, build_model(cfg, str(tiny_v4_dense_dir), torch.float32, progress=False)


def _engine(v4, **kw) -> LLMEngine:
    d, cfg, model = v4
    kw.setdefault("max_model_len", 256)
    ec = EngineConfig(model=str(d), dtype="float32", **kw).resolve(cfg)
    return LLMEngine(ec, model_config=cfg, worker=Worker(cfg, ec, model=model))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 128000, (n - 1,), generator=g).tolist()


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.stats().num_used_blocks == 0
    return [finals[f"r{i}"] for i in range(len(prompts))]


def _reference(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(ids[p] | ids[:p]) for p >= 1 from one logits row per position."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def _values(prompt_logprobs, ids):
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for entry, tok in zip(prompt_logprobs[1:], ids[1:]):
        assert next(iter(entry)) == tok  # the prompt token comes first
        assert len(entry) in (K, K + 1)  # plus the top-k (it may be one of them)
    return torch.tensor([e[t].logprob for e, t in zip(prompt_logprobs[1:], ids[1:])])


PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)


def test_prompt_logprobs_equal_teacher_forced_logits_under_any_chunking(v4):
    _, _, model = v4
    prompts = [_prompt(n, n) for n in (1, 2, 37, 90)]
    refs = [_reference(run_chunks(model, p, [len(p)]), p) for p in prompts]
    for budget in (2048, 16, 7):  # whole prompts, then chunks of the token budget
        outs = _run(_engine(v4, max_num_seqs=4, max_num_batched_tokens=budget), prompts, PARAMS)
        for o, p, ref in zip(outs, prompts, refs):
            got = _values(o.prompt_logprobs, p)
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-5 if len(p) > 1 else True
            for entry, tok in zip(o.prompt_logprobs[1:], p[1:]):
                top = sorted((v for t, v in entry.items() if v.rank <= K and not (t == tok and len(entry) > K)),
                             key=lambda v: v.rank)
                assert [v.rank for v in top] == list(range(1, K + 1))
                assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))


def test_prompt_logprobs_survive_preemption_without_duplicates(v4):
    _, _, model = v4
    prompts = [_prompt(n, 100 + n) for n in (60, 61, 62, 63)]
    refs = [_reference(run_chunks(model, p, [len(p)]), p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=K)
    # 13 usable blocks of 16 tokens (208) for 4 sequences growing to ~100 tokens, in chunks
    # of 24 tokens: some are preempted while prefilling and while decoding.
    engine = _engine(v4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, num_kv_blocks=14)
    outs = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for o, p, ref in zip(outs, prompts, refs):
        assert (_values(o.prompt_logprobs, p) - ref).abs().max().item() < 1e-5


def test_prompt_logprobs_match_transformers(v4):
    from transformers import AutoModelForCausalLM
    d, _, _ = v4
    tf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    prompts = [_prompt(n, 7 * n) for n in (33, 120)]
    outs = _run(_engine(v4, max_num_seqs=2, max_num_batched_tokens=50), prompts, PARAMS)
    for o, p in zip(outs, prompts):
        with torch.no_grad():
            ref = _reference(tf(torch.tensor([p])).logits[0], p)
        assert (_values(o.prompt_logprobs, p) - ref).abs().max().item() < 1e-4


def test_llm_generate_returns_prompt_logprobs_and_n_shares_them(v4):
    d, cfg, model = v4
    llm = LLM.from_engine(_engine(v4, max_num_seqs=4))
    p = _prompt(20, 3)
    out = llm.generate([{"prompt_token_ids": p}],
                       SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in p[1:]]  # k = 0: the token only
    plain = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_score_tokens_is_raw_log_softmax_with_ranks():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 0.0, 0.5]])
    s = score_tokens(logits, torch.tensor([2, 0]), 2)
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(s.logprobs, lp[[0, 1], [2, 0]])
    assert s.ranks.tolist() == [3, 1]  # two tokens beat token 2 in row 0
    assert s.top_ids[1].tolist() == [0, 3]
    assert torch.allclose(s.top_logprobs, lp.topk(2, -1).values)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_prompt_logprobs_out_of_range_names_the_field(bad):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
