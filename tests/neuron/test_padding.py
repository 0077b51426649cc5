"""Padding rows (placeholders to a bucket) never change real rows' results and never touch real
cache rows: a padded run and an unpadded run of the same schedule agree on logits and on every
cache row of slots >= 1 / blocks >= 1; padding writes only slot 0 and block 0."""
import pytest
import torch

from deepinfer.platforms.neuron.buckets import BucketSpec
from deepinfer.platforms.neuron.graph_runner import NeuronGraphRunner
from deepinfer.platforms.neuron.platform import NeuronPlatform
from neuron_helpers import Seqs, tiny_config, tiny_model

PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
SLOTS, BLOCKS = 5, 13


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    host = NeuronPlatform(host=True)
    return tiny_model(tiny_config(request.param), host), host


def _owner_rows(cache_tensor, n_owners):
    per = cache_tensor.shape[0] // n_owners
    return torch.arange(cache_tensor.shape[0]) // per


def _all_caches(cache):
    for layer, t in cache.swa.items():
        yield f"swa{layer}", t, SLOTS
    for key, t in cache.comp_state.items():
        yield f"state{key}", t, SLOTS
    for layer, t in cache.entries.items():
        yield f"entries{layer}", t, BLOCKS
    for layer, t in cache.index_keys.items():
        yield f"index{layer}", t, BLOCKS


def test_padding_rows_never_change_real_rows(model):
    m, host = model
    padded = Seqs(m, NeuronGraphRunner, PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS, platform=host,
                  buckets=BucketSpec(batch=(4,), contexts=(64,), prefill_tokens=24), compile=False)
    plain = Seqs(m, NeuronGraphRunner, PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS, platform=host,
                 buckets=BucketSpec(batch=(1,), contexts=(64,), prefill_tokens=None), compile=False)
    sizes = {0: len(PROMPTS[0]), 1: len(PROMPTS[1])}
    for step in range(14):
        a, b = padded.step(sizes), plain.step(sizes)
        assert a.shape == b.shape == (2, m.cfg.vocab_size)
        assert (a - b).abs().max().item() < 1e-4, f"step {step}"
        for i in sizes:
            tok = int(b[list(sizes).index(i)].argmax())
            padded.tokens[i].append(tok)
            plain.tokens[i].append(tok)
        sizes = {0: 1, 1: 1}
    assert padded.runner.buckets_seen == {(24, 64), (4, 64)} and plain.runner.eager_steps == 14

    used_slots = {1, 2}
    used_blocks = set(padded.tables[0][:3]) | set(padded.tables[1][:3])
    scratch_written = False
    for (name, pa, n), (_, pl, _) in zip(_all_caches(padded.cache), _all_caches(plain.cache)):
        owner = _owner_rows(pa, n)
        used = used_slots if n == SLOTS else used_blocks
        real = torch.tensor([int(o) in used for o in owner])
        scratch = owner == 0
        assert torch.allclose(pa[real], pl[real], atol=1e-5), name
        assert (pa[~real & ~scratch] == 0).all(), f"{name}: padding wrote outside slot 0 / block 0"
        assert (pl[scratch] == 0).all(), f"{name}: the unpadded run touched scratch"
        assert torch.isfinite(pa).all(), name
        scratch_written |= bool((pa[scratch] != 0).any())
    assert scratch_written, "placeholders must have written the scratch slot / block"
