"""A greedy speculative step in host-mode Neuron regions is one device program (spec/greedy_step.py):
the verification forward, the acceptance and the next draft block, with one host->device and one
device->host copy, and the greedy tokens of the CPU platform's plain run, at nextn 1 .. 5, for one row
and several, on both tiny V4.1 checkpoints; its drafts equal the host path's. A step with a sampled
row verifies on the host instead."""
import pytest

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops.op_census import EAGER_OPS_TARGET, OpCensus
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform

from tests.support.spec_runs import oracle_drafts, platform_llm, prompts_of_lengths, token_lists

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _neuron_llm(d, cfg, nextn):
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + nextn)
    llm = platform_llm(d, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=nextn)
    strategy = llm.llm_engine.worker.runner.strategy
    strategy.census = OpCensus()
    return llm, strategy


@pytest.mark.parametrize("checkpoint,nextn,lens", [
    ("tiny_v41_dir", 1, (9, 20)), ("tiny_v41_dir", 2, (13,)), ("tiny_v41_dir", 3, (9, 20)),
    ("tiny_v41_dir", 4, (20,)), ("tiny_v41_dir", 5, (9, 20)), ("tiny_v41_l4_dir", 3, (9, 20))])
def test_greedy_spec_steps_copy_once_each_way_and_keep_plain_greedy_tokens(request, monkeypatch, checkpoint,
                                                                           nextn, lens):
    d = request.getfixturevalue(checkpoint)
    cfg = ModelConfig.from_pretrained(d)
    prompts = prompts_of_lengths(lens, seed=7)
    want = token_lists(platform_llm(d, cfg, CpuPlatform()).generate(prompts, GREEDY, use_tqdm=False))
    oracle_drafts(monkeypatch, prompts, want, corrupt=0.5)   # accepted runs and rejections
    llm, strategy = _neuron_llm(d, cfg, nextn)
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    steps = strategy.census.steps
    fused = [s for s in steps if s.label.startswith("verify_draft")]
    assert fused, [s.label for s in steps]
    for s in fused:
        assert s.host_to_device == 1 and s.device_to_host == 1, s.to_dict()
        assert s.phases == ["step", "draft"] and s.num_eager_ops <= EAGER_OPS_TARGET, s.to_dict()
    # every verification step ran on the device: none verified on the host
    assert not [s.label for s in steps if s.label.startswith("verify ")]
    stats = llm.llm_engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # the acceptance and draft block compiled one planned graph, no more
    assert strategy.regions.stats.regions["verify_draft"] == 1
    assert strategy.num_graphs <= strategy.plan.graph_count


def test_a_step_with_a_sampled_row_verifies_on_the_host(tiny_v41_dir):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompts = prompts_of_lengths((9, 20), seed=7)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    want = token_lists(platform_llm(tiny_v41_dir, cfg, CpuPlatform()).generate(prompts[:1], GREEDY, use_tqdm=False))
    llm, strategy = _neuron_llm(tiny_v41_dir, cfg, 3)
    got = token_lists(llm.generate(prompts, [GREEDY, sampled], use_tqdm=False))
    assert got[0] == want[0]
    labels = [s.label for s in strategy.census.steps]
    # both rows decode together to the end (same max_tokens): no step of theirs verifies on the device
    assert any(x.startswith("verify ") for x in labels) and not any(x.startswith("verify_draft") for x in labels)


def test_device_drafts_equal_the_host_paths(tiny_v41_dir, monkeypatch):
    """The model's own drafts (no oracle): the draft block built on the device from the device's
    acceptance proposes what the host path (host verification, block built on the host, argmax heads
    in the draft region) proposes from the same request and length."""
    from deepinfer.spec import proposer
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompts = prompts_of_lengths((9, 20), seed=11)
    made = {"device": {}, "host": {}}   # (prompt length, length after the step) -> (drafts, confidences)
    real_propose, real_take = proposer.DraftProposer.propose, proposer.DraftProposer.take_drafts

    def record(where, scheduled, results):
        for i, r in results.items():
            if r.proposal:
                key = (scheduled[i].seq.prompt_len, len(scheduled[i].seq) + len(r.tokens))
                made[where][key] = (r.proposal.token_ids, r.proposal.confidences)

    def propose(self, scheduled, results):
        real_propose(self, scheduled, results)
        record("host", scheduled, results)

    def take(self, scheduled, results, drafted):
        real_take(self, scheduled, results, drafted)
        record("device", scheduled, results)
    monkeypatch.setattr(proposer.DraftProposer, "propose", propose)
    monkeypatch.setattr(proposer.DraftProposer, "take_drafts", take)
    llm, _ = _neuron_llm(tiny_v41_dir, cfg, 3)
    device_tokens = token_lists(llm.generate(prompts, GREEDY, use_tqdm=False))
    fused = made["device"]
    assert len(fused) >= 4
    # the same engine verifying on the host
    made["host"].clear()
    monkeypatch.setattr(NeuronRegionStrategy, "greedy_spec_inputs", lambda self, chunks, num_rows: None)
    llm, _ = _neuron_llm(tiny_v41_dir, cfg, 3)
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == device_tokens
    host = made["host"]
    assert fused.keys() <= host.keys(), (sorted(fused), sorted(host))
    for key, (ids, confs) in fused.items():
        assert ids == host[key][0], (key, ids, host[key])
        assert max(abs(a - b) for a, b in zip(confs, host[key][1])) < 1e-5, (key, confs, host[key])
