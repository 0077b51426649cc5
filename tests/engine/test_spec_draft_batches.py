"""The drafter's per-depth sampling batches (spec/proposer.DraftDepthBatches) are the batches it
would build from scratch at every depth, and the sampler's kept random-row logprobs are the processed
distribution the draws came from (what the drafter stores as q)."""
import dataclasses

import torch

from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import Sequence
from deepinfer.spec.proposer import DRAFT_SEED_OFFSET, DraftDepthBatches
from deepinfer.stop_rules import banned_token_ids

EOS = [1]


def _seq(i, params, outputs=(5, 6)):
    return Sequence(f"r{i}", i, [0, 7, 8, 9], params, seed=1000 + i, output_token_ids=list(outputs))


def _fresh(seqs, new_lens, extra, toks, k):
    """What the drafter built at depth k before reusing batches."""
    return SamplingBatch.build(
        [x.sampling_params for x in seqs], [nl + k for nl in new_lens],
        seeds=[x.seed + DRAFT_SEED_OFFSET for x in seqs],
        banned_ids_per_row=[tuple(banned_token_ids(x, EOS, len(e) + k)) for x, e in zip(seqs, extra)],
        output_ids_per_row=[x.output_token_ids + e + [int(t[c]) for t in toks]
                            for c, (x, e) in enumerate(zip(seqs, extra))],
        prompt_ids_per_row=[x.prompt_token_ids for x in seqs], need_logprobs=False)


def _same(a: SamplingBatch, b: SamplingBatch) -> bool:
    for f in dataclasses.fields(SamplingBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is None or y is None or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _check(seqs, expect_static):
    new_lens, extra, toks = [len(x) + 1 for x in seqs], [[3] for _ in seqs], []
    batches = DraftDepthBatches(seqs, new_lens, extra, EOS, 4)
    assert batches.static == expect_static
    for k in range(4):
        got = batches.at(k, toks, "cpu")
        assert _same(got, _fresh(seqs, new_lens, extra, toks, k)), k
        toks.append([40 + k + c for c in range(len(seqs))])


def test_reused_batches_equal_fresh_ones_without_penalties_or_changing_bans():
    seqs = [_seq(0, SamplingParams(temperature=0.0)), _seq(1, SamplingParams(temperature=0.7, top_k=5)),
            _seq(2, SamplingParams(temperature=1.0, min_tokens=1))]  # min_tokens already met: no bans
    _check(seqs, expect_static=True)


def test_rebuilt_when_bans_change_with_depth_or_rows_are_penalised():
    # min_tokens = 5 with 2 outputs and 1 emitted: EOS is banned at depths 0 and 1 only
    _check([_seq(0, SamplingParams(temperature=0.0, min_tokens=5))], expect_static=False)
    _check([_seq(0, SamplingParams(temperature=0.0)),
            _seq(1, SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2))],
           expect_static=False)


def test_kept_random_logprobs_are_the_processed_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.1, top_p=0.7)]
    batch = SamplingBatch.build(params, [10, 11, 12, 13], seeds=[1, 2, 3, 4])
    sampler = Sampler()
    out = sampler(logits, batch, keep_random_logprobs=True)
    assert torch.equal(out.token_ids, sampler(logits, batch).token_ids)
    assert sampler(logits, batch).random_logprobs is None
    assert torch.equal(out.random_logprobs, sampler.processed_logprobs(logits, batch, batch.random_rows))
    only_random = SamplingBatch.build(params[1::2], [11, 13], seeds=[2, 4])
    kept = sampler(logits[1::2], only_random, keep_random_logprobs=True).random_logprobs
    assert torch.equal(kept, out.random_logprobs)
