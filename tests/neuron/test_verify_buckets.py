"""Verification steps in power-of-two buckets (docs/neuron.md §4 B3, §5.1): at nextn 1..5 a step of
rows x (1 + nextn) tokens runs in host-mode region graphs padded to a power of two with placeholder
rows, and greedy tokens with (oracle) drafts equal the CPU platform's plain greedy tokens."""
import pytest

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model_executor.static_step import BucketSpec, next_pow2
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform

from tests.support.spec_runs import oracle_drafts, platform_llm, prompts_of_lengths, token_lists

PROMPT_LENS = (9, 20)


def _plain_greedy(d, max_tokens):
    cfg = ModelConfig.from_pretrained(d)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = prompts_of_lengths(PROMPT_LENS, seed=7)
    return cfg, prompts, params, token_lists(platform_llm(d, cfg, CpuPlatform()).generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def plain_short(tiny_v41_dir):
    return _plain_greedy(tiny_v41_dir, 6)


def _check(d, monkeypatch, nextn, cfg, prompts, params, want, rejects=False):
    oracle_drafts(monkeypatch, prompts, want, corrupt=0.5)
    # decode rows of 2; prompt steps eager (compiling stays short); the Neuron spec pads tokens to
    # powers of two, as NeuronPlatform.bucket_spec builds it
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + nextn, pow2_tokens=True)
    llm = platform_llm(d, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=nextn)
    got = token_lists(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    strategy = llm.llm_engine.worker.runner.strategy
    assert strategy.name == "neuron_regions"
    verify = next_pow2(2 * (1 + nextn))
    # decode steps ran compiled: rows of 2 (a step without drafts) or the verification bucket
    assert (verify, 64) in strategy.buckets_seen <= {(2, 64), (verify, 64)}, strategy.buckets_seen
    assert all(t & (t - 1) == 0 for t, _ in strategy.buckets_seen)
    spec = llm.llm_engine.stats().spec_decode
    assert spec.num_accepted_tokens > 0
    if rejects:   # a long run also rolls rejected drafts back
        assert spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("nextn", [1, 2, 3, 4, 5])
def test_power_of_two_verification_buckets_keep_plain_greedy_tokens(tiny_v41_dir, plain_short, monkeypatch, nextn):
    """2 x (1 + nextn) = 4, 6, 8, 10, 12 tokens run in buckets of 4, 8, 8, 16, 16: a placeholder row
    carries the padding (and the tokens of a finished or short row)."""
    _check(tiny_v41_dir, monkeypatch, nextn, *plain_short)


@pytest.mark.parametrize("nextn", [3, 5])
def test_power_of_two_verification_buckets_keep_plain_greedy_tokens_long(tiny_v41_dir, monkeypatch, nextn):
    _check(tiny_v41_dir, monkeypatch, nextn, *_plain_greedy(tiny_v41_dir, 24), rejects=True)


def test_warm_up_compiles_the_planned_verification_graphs():
    """The plan counts the padded verification bucket (2 x 6 -> 16 tokens, three sub-regions a
    kind) next to the decode rows, and warm-up compiles exactly the plan."""
    from deepinfer.neuron_ops.regions import SUB_REGIONS, TOP_REGIONS, RegionRunner
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    from tests.support.model_helpers import Seqs, tiny_config, tiny_model
    host = NeuronPlatform(host=True)
    model = tiny_model(tiny_config("v41"), host)
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=6, pow2_tokens=True)
    regions = RegionRunner("aot_eager", split="multi_row")
    s = Seqs(model, NeuronRegionStrategy, [[0, 5, 6]], platform=host, buckets=spec, regions=regions)
    plan = s.strategy.plan
    # (the tiny V4.1 has DSpark layers: its draft block of 2 rows x 5 drafts, padded to 16 tokens, is a
    # planned graph too)
    assert [(b["step"], b["tokens"]) for b in plan.buckets()] == [("decode", 2), ("verify", 16), ("draft", 16)]
    by_region = plan.counts("region")
    layer_graphs = sum(n for r, n in by_region.items() if r not in TOP_REGIONS)
    assert s.runner.warm_up() == plan.graph_count == layer_graphs + sum(by_region.get(r, 0) for r in TOP_REGIONS)
    assert layer_graphs == regions.num_kinds * (1 + len(SUB_REGIONS))   # kinds are known once compiled


def test_platform_buckets_verify_in_the_decode_bucket_with_its_graphs(tiny_v41_dir, plain_short, monkeypatch):
    """The platform's own buckets (rows 2 and 8): 2 rows x (1 + 1) = 4 tokens verify in the 8-row decode
    bucket's shape, one region a layer (split policy "prompt"), so no verification graph is compiled;
    greedy tokens with (oracle) drafts equal the CPU platform's."""
    cfg, prompts, params, want = plain_short
    monkeypatch.setenv("DEEPINFER_NEURON_ROW_BUCKETS", "2,8")
    monkeypatch.delenv("DEEPINFER_NEURON_VERIFY_ROWS", raising=False)
    monkeypatch.delenv("DEEPINFER_NEURON_REGION_SPLIT", raising=False)
    oracle_drafts(monkeypatch, prompts, want, corrupt=0.5)
    llm = platform_llm(tiny_v41_dir, cfg, NeuronPlatform(host=True), num_speculative_tokens=1)
    strategy = llm.llm_engine.worker.runner.strategy
    assert strategy.buckets.verify_batch == (2,) and strategy.buckets.verify_bucket_tokens(2) == 8
    assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == want
    assert (8, 64) in strategy.buckets_seen   # verification steps in the 8-token bucket
    assert "verify" not in strategy.plan.counts("step")
    assert strategy.num_graphs <= strategy.plan.graph_count   # nothing compiled beyond the plan
