"""Golden: deepinfer's V4 forward vs transformers' DeepseekV4ForCausalLM on the same tiny checkpoint files."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import run_batch, run_chunks



@pytest.fixture(scope="module")
def models(tiny_v4_dense_dir):
    from transformers import AutoModelForCausalLM
    tf = AutoModelForCausalLM.from_pretrained(str(tiny_v4_dense_dir), dtype=torch.float32).eval()
    cfg = ModelConfig.from_pretrained(tiny_v4_dense_dir)
    ours = build_model(cfg, str(tiny_v4_dense_dir), torch.float32, progress=False)
    return tf, ours


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 128000, (n - 1,), generator=g).tolist()


@pytest.mark.parametrize("n", [40, 100, 259])
def test_prefill_logits_match_transformers(models, n):
    tf, ours = models
    ids = _prompt(n, n)
    with torch.no_grad():
        ref = tf(torch.tensor([ids])).logits[0].float()
    got = run_chunks(ours, ids, [n])
    assert got.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() >= 0.999
    assert (got - ref).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_decode_and_chunked_match_transformers(models):
    tf, ours = models
    ids = _prompt(70, 7)
    with torch.no_grad():
        ref = tf(torch.tensor([ids])).logits[0].float()
    decode = run_chunks(ours, ids, [1] * 70)
    chunked = run_chunks(ours, ids, [13, 1, 32, 24])
    for got in (decode, chunked):
        assert (got - ref).abs().max().item() < 1e-3
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_batched_prefill_matches_single(models):
    _, ours = models
    prompts = [_prompt(n, n + 1) for n in (17, 64, 33)]
    batched = run_batch(ours, prompts)
    for p, got in zip(prompts, batched):
        assert (got - run_chunks(ours, p, [len(p)])).abs().max().item() < 1e-4


def test_greedy_generation_matches_transformers(models):
    tf, ours = models
    for n in (24, 90):
        ids = _prompt(n, 100 + n)
        with torch.no_grad():
            ref = tf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, n:].tolist()
        toks = list(ids)
        for _ in range(8):
            toks.append(int(run_chunks(ours, toks, [len(toks)])[-1].argmax()))
        assert toks[n:] == ref
