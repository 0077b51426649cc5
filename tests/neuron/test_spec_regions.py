"""Speculative decoding in host-mode Neuron region graphs: verification rows run in their own row
buckets (rows of 1 + B tokens, padded to a power of two with placeholder rows), and greedy tokens
with (oracle) drafts equal the CPU platform's plain greedy tokens."""

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform

from tests.support.spec_runs import oracle_drafts, platform_llm, prompts_of_lengths, token_lists

B = 3


def test_verification_rows_in_region_graphs_give_cpu_greedy_tokens(tiny_v41_dir, monkeypatch):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompts = prompts_of_lengths((9, 20), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = token_lists(platform_llm(tiny_v41_dir, cfg, CpuPlatform()).generate(prompts, params, use_tqdm=False))
    oracle_drafts(monkeypatch, prompts, want)
    # Decode rows of 2, verification rows of 2 x (1 + B); prompt steps eager, to keep compiling short
    # (the platform's own spec adds its prefill bucket: NeuronPlatform.bucket_spec).
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + B)
    llm = platform_llm(tiny_v41_dir, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=B)
    got = token_lists(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    strategy = llm.llm_engine.worker.runner.strategy
    assert strategy.name == "neuron_regions"
    # every decode step ran compiled: rows of 2 (first tokens) or 2 x (1 + B) (verification)
    assert strategy.buckets_seen == {(2, 64), (2 * (1 + B), 64)}, strategy.buckets_seen
    spec = llm.llm_engine.stats().spec_decode
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens


def test_verification_rows_pick_power_of_two_row_buckets():
    from deepinfer.model_executor.forward_meta import SeqChunk
    from deepinfer.model_executor.static_step import Bucket
    spec = BucketSpec(batch=(1, 2, 4), contexts=(64,), prefill_tokens=(32,), verify_tokens=4)

    def rows(*sizes):
        return [SeqChunk(slot=i + 1, ctx_len=10, num_new=n, block_table=[1], token_ids=[0] * 20, num_logits=n)
                for i, n in enumerate(sizes)]
    assert spec.select(rows(1, 1)) == Bucket(2, 2, 64)           # plain decode rows
    assert spec.select(rows(4, 4, 4)) == Bucket(4, 16, 64)       # three verification rows -> 4
    # a short row: a placeholder chunk beyond the two row slots carries the rest (graphs depend on
    # the tokens alone, so two rows run in the 2-row bucket rather than the 4-row one)
    assert spec.select(rows(4, 2)) == Bucket(3, 8, 64)
    assert spec.select(rows(4, 4)) == Bucket(2, 8, 64)           # full rows: no placeholder
    assert spec.select(rows(4, 4, 4, 4, 1)).num_tokens == 32     # more rows than any bucket: the prompt bucket
    assert spec.select(rows(9)).num_tokens == 32                 # longer than a verification row
    padded = spec.static_step(rows(4, 2), Bucket(4, 16, 64), _layout())
    assert padded.num_tokens == 16 and padded.logits_indices.numel() == 6


def _layout():
    from deepinfer.model_executor.forward_meta import CacheLayout
    return CacheLayout(window=8, num_slots=5, block_size=16, compressors=[(2, 2, False)], extra_ring_rows=4)
