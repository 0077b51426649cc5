"""Penalties, logit_bias and the grammar bitmask against a direct per-row formula on the logits,
through the production sampler (SamplingBatch.build + Sampler.forward)."""
import pytest
import torch

from deepinfer.model_executor.layers.logits_penalties import unpack_bitmask
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.sampling_params import SamplingParams, SamplingParamsError

V = 300


def formula_row(logits, p: SamplingParams, prompt, outputs, allowed=None):
    """vLLM's order, one token at a time: mask, bias, repetition, frequency, presence."""
    x = [float(v) for v in logits]
    for t in range(V):
        if allowed is not None and t not in allowed:
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = set(prompt) | set(outputs)
    for t in range(V):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = outputs.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c else 0)
    return torch.tensor(x, dtype=torch.float32)


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, V, generator=g) * 3
    hist = lambda n: torch.randint(0, 40, (n,), generator=g).tolist()  # noqa: E731  (many repeats)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=-0.7, logit_bias={3: 100.0, 7: -50.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=2.0, presence_penalty=-2.0,
                       logit_bias={5: 2.5}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={299: 7.0}),
    ]
    prompts = [hist(12) for _ in params]
    outputs = [hist(20) for _ in params]
    return logits, params, prompts, outputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adjusted_logits_equal_formula_and_greedy_takes_their_argmax(seed):
    logits, params, prompts, outputs = _case(seed)
    batch = SamplingBatch.build(params, [30] * 6, output_ids_per_row=outputs, prompt_ids_per_row=prompts)
    adjusted = Sampler.adjusted_logits(logits, batch)
    want = torch.stack([formula_row(logits[i], params[i], prompts[i], outputs[i]) for i in range(6)])
    torch.testing.assert_close(adjusted, want, rtol=0, atol=1e-5)
    assert not torch.equal(adjusted[:4], logits[:4])  # every penalised row really changed
    assert torch.equal(adjusted[4], logits[4])  # the plain row is untouched
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == want.argmax(dim=-1).tolist()


def test_penalised_logprobs_and_seeded_draws_are_batch_independent():
    logits, params, prompts, outputs = _case(5)
    params = [SamplingParams(temperature=0.8, seed=11 + i, frequency_penalty=1.0, logit_bias={1: 3.0},
                             repetition_penalty=1.3, logprobs=2) for i in range(6)]
    full = Sampler()(logits, SamplingBatch.build(params, list(range(6)), output_ids_per_row=outputs,
                                                 prompt_ids_per_row=prompts))
    for i in (0, 3, 5):
        alone = Sampler()(logits[i:i + 1], SamplingBatch.build(
            [params[i]], [i], output_ids_per_row=[outputs[i]], prompt_ids_per_row=[prompts[i]]))
        assert alone.token_ids.item() == full.token_ids[i].item()
        assert alone.logprobs.item() == pytest.approx(full.logprobs[i].item(), abs=1e-6)
        # The logprob is the processed (penalised, tempered) distribution's.
        want = torch.log_softmax(formula_row(logits[i], params[i], prompts[i], outputs[i]) / 0.8, -1)
        assert full.logprobs[i].item() == pytest.approx(want[full.token_ids[i]].item(), abs=1e-4)


def _pack(allowed: set[int], vocab: int) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_bitmask_masks_only_its_row_and_unpacks_every_bit():
    allowed = {0, 31, 32, 63, 95, 250, 299}  # bit 31 is the int32 sign bit
    mask = _pack(allowed, V)
    assert unpack_bitmask(mask.unsqueeze(0), V)[0].nonzero().flatten().tolist() == sorted(allowed)
    logits, params, prompts, outputs = _case(3)
    params = [SamplingParams(temperature=0.0, logit_bias={31: -5.0}), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [0, 0], bitmask_per_row=[mask, None])
    adjusted = Sampler.adjusted_logits(logits[:2], batch)
    torch.testing.assert_close(adjusted[0], formula_row(logits[0], params[0], [], [], allowed))
    assert torch.equal(adjusted[1], logits[1])
    assert Sampler()(logits[:2], batch).token_ids[0].item() in allowed


@pytest.mark.parametrize("kw,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={-2: 1}), "logit_bias"), (dict(logit_bias={"3": 1}), "logit_bias"),
])
def test_out_of_range_penalties_name_the_field(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
