"""Verification inputs shared by the verification tests (spec/verify.py): a batch of requests of every sampling kind with
target logits, drafts close to (not equal to) the target, and some requests verifying fewer drafts."""
import torch

from deepinfer.spec.verify import NO_TOKEN
from deepinfer.sampling_params import SamplingParams


def mixed_case(r=60, b=4, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(temperature=1.2, top_k=7),
             SamplingParams(temperature=0.9, min_p=0.1)]
    params = [kinds[i % len(kinds)] for i in range(r)]
    logits = torch.randn(r, b + 1, vocab, generator=g) * 2
    # Drafts close to the target (so acceptance varies) but not equal to it.
    draft_lp = torch.log_softmax(logits[:, :b] + torch.randn(r, b, vocab, generator=g), -1)
    drafts = torch.multinomial(draft_lp.exp().reshape(-1, vocab), 1, generator=g).reshape(r, b)
    drafts[::7, 2:] = NO_TOKEN  # some requests verify only 2 drafts
    return params, logits, drafts, draft_lp
