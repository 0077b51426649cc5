"""Argmax drafts inside the DSpark draft block's region (models/dspark_draft.py greedy_drafts,
worker/runners/neuron_regions.py, spec/proposer.py argmax_drafts): the drafts and confidences equal
what the host path (the block's rows copied back, the heads and the sampler per depth) gives, ties go
to the lowest id as the sampler's greedy rows, the block's power-of-two padding leaves the real rows
as they are, and only rows whose drafts are plain argmaxes take this path."""
import json
import random
from types import SimpleNamespace

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model_executor.forward_meta import step_to
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.model_executor.models import dspark_draft
from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs, greedy_drafts
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.spec.proposer import argmax_drafts

from tests.support.spec_runs import platform_llm, prompts_of_lengths

B = 3


def _sampled_argmax(logits: torch.Tensor, position: int) -> list[int]:
    rows = logits.shape[0]
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * rows, [position] * rows)
    return Sampler()(logits, batch).token_ids.tolist()


def test_greedy_drafts_break_ties_to_the_lowest_id_as_the_sampler(monkeypatch):
    v, r = 16, 2

    def heads(model, hidden, base, prev):   # two tied maxima a depth, placed by the previous draft
        lg = base.clone()
        at = torch.arange(prev.shape[0])
        lg[at, (prev + 3) % v] = 5.0
        lg[at, (prev + 1) % v] = 5.0
        return lg, prev.float() / 10
    monkeypatch.setattr(dspark_draft, "draft_heads", heads)
    base = torch.randn(r * B, v)
    first = torch.tensor([0, 14])   # row 1: ids 15 and 1 tie, the lowest is 1
    drafts, conf = greedy_drafts(None, torch.zeros(r * B, 4), base, first, B)
    prev = first
    for k in range(B):
        lg, c = heads(None, None, base.view(r, B, v)[:, k], prev)
        want = _sampled_argmax(lg, 10 + k)
        assert drafts[:, k].tolist() == want and torch.equal(conf[:, k], c)
        prev = torch.tensor(want)
    assert drafts[1, 0] == 1


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_in_graph_argmax_drafts_equal_the_host_path(tiny_v41_dir, tmp_path, draft_vocab):
    """Also with a draft vocabulary (models/draft_vocab.py): the region's column argmax mapped to ids
    equals the host path's heads expanded to the whole vocabulary and sampled."""
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + B, pow2_tokens=True)
    vocab, kw = None, {}
    if draft_vocab:
        vocab = sorted(random.Random(5).sample(range(cfg.vocab_size), 600))
        kw["speculative_draft_vocab"] = str(tmp_path / "vocab.json")
        (tmp_path / "vocab.json").write_text(json.dumps({"token_ids": vocab}))
    llm = platform_llm(tiny_v41_dir, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=B,
                       **kw)
    # a few steps, so that the slots' window rings hold main keys
    llm.generate(prompts_of_lengths((9, 20), seed=3), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    runner = llm.llm_engine.worker.runner
    strategy, noise = runner.strategy, int(cfg.dspark_noise_token_id)
    block = DraftBlock(slots=[1, 2], last_pos=[7, 12], first_tokens=[5, 99], block=B)
    assert strategy.draft_tokens(2) == 8   # 2 x 3 tokens padded to a power of two
    drafts, conf = runner.draft_greedy(block, noise)
    hidden, base = runner.draft(block, noise)    # the same region graph, its rows copied back
    prev, want, want_conf = torch.tensor(block.first_tokens), [], []
    for k in range(B):
        lg, c = runner.draft_heads(hidden.view(2, B, -1)[:, k], base.view(2, B, -1)[:, k], prev)
        prev = torch.tensor(_sampled_argmax(lg, 20 + k))
        want.append(prev.tolist())
        want_conf.append(c)
    assert drafts.tolist() == [list(t) for t in zip(*want)]
    assert torch.equal(conf, torch.stack(want_conf, dim=1))
    if vocab is not None:   # the block's logits cover the draft columns only, and the drafts are in the vocabulary
        assert base.shape[1] == -(-len(vocab) // 16) * 16 and set(drafts.flatten().tolist()) <= set(vocab)
    # the padded block's real rows equal the unpadded block's, run eagerly
    eager_hidden, eager_base = strategy.model.draft(step_to(draft_step_inputs(block, strategy.layout, noise), "cpu"),
                                                    runner.cache)
    torch.testing.assert_close(base, eager_base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, eager_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params, output_ids, expected", [
    (SamplingParams(temperature=0.0), [], True),
    (SamplingParams(temperature=0.0, min_tokens=2), [7], True),       # min_tokens met before depth 0
    (SamplingParams(temperature=0.0, min_tokens=4), [7], False),      # EOS banned at some depth
    (SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True), [7], True),
    (SamplingParams(temperature=0.7, seed=1), [], False),             # sampled: host draws
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), [], False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), [], False),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [], False),
])
def test_only_plain_argmax_rows_draft_in_the_region(params, output_ids, expected):
    seq = SimpleNamespace(sampling_params=params, grammar=None, output_token_ids=output_ids)
    assert argmax_drafts(seq, [1], emitted=1, depths=B) is expected
    assert argmax_drafts(SimpleNamespace(sampling_params=SamplingParams(temperature=0.0), grammar=object(),
                                         output_token_ids=[]), [1], emitted=1, depths=B) is False
