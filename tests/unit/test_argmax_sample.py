"""ModelRunner.sample's plain-argmax rows (every row greedy with nothing the sampler would change or
report: the head's argmax is the token) against the sampler itself on logits with exact and one-ulp
ties; a step with a row that needs the sampler (a ban, logprobs, a bias, a penalty, a grammar mask, a
sampled row) builds its sampling batch as before."""
import torch

from deepinfer.model_executor.layers import sampler as sampler_module
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.model_runner import ModelRunner, SampleRequest
from tests.support.tie_logits import near_tie_logits


def _runner() -> ModelRunner:
    return ModelRunner(model=None, cache=None, layout=None, strategy=None)


def _sampler_tokens(logits, samples):
    batch = SamplingBatch.build([s.params for s in samples], [s.position for s in samples],
                                seeds=[s.seed for s in samples], banned_ids_per_row=[s.banned_ids for s in samples],
                                bitmask_per_row=[s.bitmask for s in samples])
    return Sampler().forward(logits, batch).token_ids


def _counting_builds(monkeypatch) -> list:
    calls = []
    build = SamplingBatch.build.__func__

    def counted(cls, *args, **kwargs):
        calls.append(1)
        return build(cls, *args, **kwargs)
    monkeypatch.setattr(sampler_module.SamplingBatch, "build", classmethod(counted))
    return calls


def test_plain_greedy_rows_take_the_heads_argmax_as_the_sampler_would(monkeypatch):
    logits = near_tie_logits(16, 1, seed=3)[:, 0]
    head = logits.argmax(dim=-1).to(torch.int32)   # ties to the lowest id, as the head kernels keep them
    samples = [SampleRequest(SamplingParams(temperature=0.0), position=10 + i) for i in range(16)]
    ref = _sampler_tokens(logits, samples)
    builds = _counting_builds(monkeypatch)
    out = _runner().sample(logits, samples, row_argmax=head)
    assert not builds   # no sampling batch
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    assert torch.equal(out.token_ids, ref)


def test_a_row_that_needs_the_sampler_keeps_the_sampling_batch(monkeypatch):
    logits = near_tie_logits(4, 1, seed=5)[:, 0]
    top = logits.argmax(dim=-1)
    mask = torch.zeros((logits.shape[1] + 31) // 32, dtype=torch.int32)
    mask[int(top[0]) // 32] = 1 << (int(top[0]) % 32)
    cases = [dict(params=SamplingParams(temperature=0.0), banned_ids=(int(top[0]),)),
             dict(params=SamplingParams(temperature=0.0, logprobs=0)),
             dict(params=SamplingParams(temperature=0.0, logit_bias={int(top[1]): 100.0})),
             dict(params=SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt_token_ids=(int(top[0]),)),
             dict(params=SamplingParams(temperature=0.0, presence_penalty=0.5), output_token_ids=(int(top[0]),)),
             dict(params=SamplingParams(temperature=0.0), bitmask=mask),
             dict(params=SamplingParams(temperature=1.0), seed=7)]
    for kw in cases:
        samples = [SampleRequest(position=20, **kw)] + [SampleRequest(SamplingParams(temperature=0.0), 21 + i)
                                                        for i in range(3)]
        ref = _runner().sample(logits, samples)   # no head argmax: the sampler's own scan
        builds = _counting_builds(monkeypatch)
        out = _runner().sample(logits, samples, row_argmax=top)
        assert builds == [1], kw
        assert torch.equal(out.token_ids, ref.token_ids), kw
        monkeypatch.undo()
