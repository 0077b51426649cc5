"""The host's plain-argmax verification (spec/decoder.py SpecDecoder._verify_argmax) against its general
verification (`_verify`: a VerifyBatch, spec/verify.py) on logits with exact ties and ties by one ulp:
the same emitted tokens and accepted counts for rows of different draft counts, read from the head's
argmax or from the logits; rows that need the sampler (logprobs, a min_tokens ban, a logit bias, a sampled
row) go the general way."""
import torch

from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import Sequence
from deepinfer.spec.decoder import SpecDecoder
from tests.support.tie_logits import V, near_tie_logits, tie_drafts

EOS = [1]


class _Runner:
    sampler = Sampler()


class _Sched:
    def __init__(self, seq, drafts):
        self.seq, self.draft_token_ids, self.do_sample = seq, drafts, True


def _seq(i: int, params: SamplingParams) -> Sequence:
    return Sequence(request_id=str(i), seq_id=i, prompt_token_ids=[0, 5, 6], sampling_params=params, seed=7 + i,
                    output_token_ids=[9, 10])


def _case(b: int, seed: int, params: SamplingParams):
    """(decoder, scheduled, spec rows, flat logits): 12 rows of up to b drafts, one verification row
    per draft and one more, rows following one another in the step's logits after a plain row."""
    r = 12
    logits = near_tie_logits(r, b + 1, seed)
    drafts = tie_drafts(logits, seed + 50)
    scheduled, spec, chunks = [], [], [torch.randn(1, V)]
    row = 1
    for i in range(r):
        d = [t for t in drafts[i].tolist() if t >= 0][: (i % (b + 1))]   # 0 .. b drafts
        scheduled.append(_Sched(_seq(i, params), d))
        spec.append((i, row))
        chunks.append(logits[i, :len(d) + 1])
        row += len(d) + 1
    return SpecDecoder(_Runner(), b, 4096, EOS, noise_id=2), scheduled, spec, torch.cat(chunks)


def _as_lists(found):
    return {i: (r.tokens, r.num_drafts, r.num_accepted) for i, r in found.items()}


def test_argmax_verification_equals_the_general_one_on_near_ties():
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    for b in (1, 3, 5):
        dec, scheduled, spec, flat = _case(b, seed=b, params=greedy)
        general = _as_lists(dec._verify(scheduled, spec, flat))
        accepted = [n for _, _, n in general.values()]
        assert any(n > 0 for n in accepted) and any(n < d for _, d, n in general.values())
        assert _as_lists(dec._verify_argmax(scheduled, spec, flat)) == general
        # the head's argmax of every logits row stands for the scan (ties to the lowest id, as first_argmax)
        assert _as_lists(dec._verify_argmax(scheduled, spec, flat, flat.argmax(dim=-1))) == general


def test_rows_that_need_the_sampler_take_the_general_verification():
    for params in (SamplingParams(temperature=0.0, max_tokens=64, logprobs=0),
                   SamplingParams(temperature=0.0, max_tokens=64, min_tokens=5),   # EOS banned at some depth
                   SamplingParams(temperature=0.0, max_tokens=64, logit_bias={3: 1.0}),
                   SamplingParams(temperature=0.8, max_tokens=64)):
        dec, scheduled, spec, flat = _case(3, seed=11, params=params)
        assert dec._verify_argmax(scheduled, spec, flat) is None, params
