"""What a Neuron host-mode decode step runs outside its compiled regions (docs/neuron.md §4 C1, C4, D3;
neuron_ops/op_census.py): with the embedding, RoPE tables, LM head and the DSpark draft block compiled
(worker/runners/neuron_regions.py), a decode step of the tiny V4.1 checkpoint runs at most
EAGER_OPS_TARGET eager aten ops and one host->device and one device->host copy, with the CPU
platform's greedy tokens; with speculative decoding a verification step of greedy rows is one device
program (the forward, the acceptance and the next draft block: spec/greedy_step.py) under the eager-op
target with one copy each way; a step verified on the host runs the draft block (its argmax drafts
inside its region) as a second program, one copy each way each; rows the host samples run the
per-depth draft heads eagerly, and the census counts them."""
import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops.op_census import EAGER_OPS_TARGET, OpCensus
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.worker import Worker, build_model

from tests.support.spec_runs import oracle_drafts, prompts_of_lengths, token_lists

B = 3
# The Engram n-gram hash (exact int64, docs/neuron.md §4 A5) runs on the host before the step's copy
# (layers/engram_host.py, §5.9), outside the census: every op counted here would be a device launch.


def _device_ops(s, phases=("step", "draft", "heads")) -> int:
    return sum(n for (_, site, phase), n in s.eager_ops.items() if phase in phases)


def _llm(d, cfg, platform, worker_kw=None, **kw):
    model = build_model(cfg, str(d), torch.float32, progress=False, platform=platform)
    ec = EngineConfig(model=str(d), dtype="float32", max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=32, **kw).resolve(cfg)
    worker = Worker(cfg, ec, model=model, platform=platform, **(worker_kw or {}))
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))


@pytest.mark.parametrize("nextn", [0, B])
def test_decode_steps_run_few_eager_ops_and_one_copy_each_way(tiny_v41_dir, monkeypatch, nextn):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompts = prompts_of_lengths((9, 20), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = token_lists(_llm(tiny_v41_dir, cfg, CpuPlatform()).generate(prompts, params, use_tqdm=False))
    if nextn:
        oracle_drafts(monkeypatch, prompts, want)
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + nextn)
    llm = _llm(tiny_v41_dir, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=nextn)
    strategy = llm.llm_engine.worker.runner.strategy
    census = strategy.census = OpCensus()
    assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == want
    steps = [s for s in census.steps if s.label.split()[0] in ("decode", "verify", "verify_draft")]
    assert steps, [s.label for s in census.steps]
    for s in steps:
        print(json.dumps(s.to_dict()))
    for s in steps:
        assert _device_ops(s) <= EAGER_OPS_TARGET, s.to_dict()
        if s.label.startswith("verify_draft"):
            # greedy rows verify and draft in one device program (spec/greedy_step.py): the step's
            # inputs in, then tokens, accepted counts and next drafts out; nothing eager in the draft part
            assert nextn and s.phases == ["step", "draft"], s.to_dict()
            assert s.host_to_device == 1 and s.device_to_host == 1, s.to_dict()
            assert s.by_phase["draft"].get("host_to_device", 0) == 0 and _device_ops(s, ("draft",)) == 0, s.to_dict()
            continue
        # the main forward: everything in regions but the inputs copy and the logits copy back
        main = s.by_phase["step"]
        assert main["host_to_device"] == 1 and main["device_to_host"] == 1, s.to_dict()
        if not nextn or "draft" not in s.phases:   # the last step of a sequence drafts nothing
            assert s.phases == ["step"], s.to_dict()
            continue
        # a step outside the verification buckets verifies on the host: its draft block is a second
        # program, one region, one copy each way, its argmax heads inside it
        draft = s.by_phase["draft"]
        assert _device_ops(s, ("draft",)) == 0 and draft["host_to_device"] == 1 and draft["device_to_host"] == 1
        assert "heads" not in s.phases and s.host_to_device == 2 and s.device_to_host == 2, s.to_dict()
    if nextn:
        assert any(s.label.startswith("verify_draft") for s in steps)


def test_sampled_drafts_run_the_heads_on_the_host(tiny_v41_dir):
    """Seeded sampled rows keep the host draws (spec/proposer.py): the block's rows come back (one copy)
    and each depth's heads run eagerly, two copies back a depth (logits and confidences)."""
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompts = prompts_of_lengths((9, 20), seed=7)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    want = token_lists(_llm(tiny_v41_dir, cfg, CpuPlatform(), num_speculative_tokens=B)
                       .generate(prompts, params, use_tqdm=False))
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None, verify_tokens=1 + B)
    llm = _llm(tiny_v41_dir, cfg, NeuronPlatform(host=True), {"buckets": buckets}, num_speculative_tokens=B)
    census = llm.llm_engine.worker.runner.strategy.census = OpCensus()
    assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == want
    drafting = [s for s in census.steps if "draft" in s.phases]
    assert drafting
    for s in drafting:
        heads = s.phases.count("heads")
        assert heads == B and s.by_phase["heads"]["device_to_host"] == 2 * heads, (s.phases, s.by_phase)
        assert s.by_phase["draft"]["device_to_host"] == 1 and _device_ops(s, ("draft",)) == 0, s.to_dict()
