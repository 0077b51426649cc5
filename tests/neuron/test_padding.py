"""Padding rows (placeholders to a bucket) never change real rows' results and never touch real
cache rows: a padded run and an unpadded run of the same schedule agree on logits and on every
cache row of slots >= 1 / blocks >= 1; padding writes only slot 0 and block 0."""
import pytest

from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
from deepinfer.platforms.neuron.platform import NeuronPlatform
from tests.support.model_helpers import (Seqs, assert_padding_wrote_only_scratch, run_in_lockstep, tiny_config,
                                         tiny_model)

PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
SLOTS, BLOCKS = 5, 13


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    host = NeuronPlatform(host=True)
    return tiny_model(tiny_config(request.param), host), host


def test_padding_rows_never_change_real_rows(model):
    m, host = model
    padded = Seqs(m, NeuronRegionStrategy, PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS, platform=host,
                  buckets=BucketSpec(batch=(4,), contexts=(64,), prefill_tokens=24), compile=False)
    plain = Seqs(m, NeuronRegionStrategy, PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS, platform=host,
                 buckets=BucketSpec(batch=(1,), contexts=(64,), prefill_tokens=None), compile=False)
    run_in_lockstep(padded, plain, 14)
    assert padded.strategy.buckets_seen == {(24, 64), (4, 64)} and plain.strategy.eager_steps == 14

    used_blocks = set(padded.tables[0][:3]) | set(padded.tables[1][:3])
    assert_padding_wrote_only_scratch(padded.cache, plain.cache, {1, 2}, used_blocks, SLOTS, BLOCKS)
