"""Compiled layer regions (host mode, aot_eager): compiled == eager, one graph per (bucket, layer
kind) plus the step's entry and exit graphs a bucket, whatever the number of layers, split regions and prompt-as-decode, and the CPU platform's
greedy tokens on both tiny checkpoints.

Graphs are shared through one RegionRunner per model type (module scope): a runner's graphs serve
every model with the same layer kinds and bucket shapes, which is itself what these tests check."""
import pytest
import torch
from torch._dynamo.utils import counters

from deepinfer.config import ModelConfig
from deepinfer.neuron_ops.regions import RegionRunner, layer_kind
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.runners.eager import EagerStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs, run_in_lockstep, tiny_config, tiny_model

PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
# V4: prompt steps padded to 16 tokens, decode steps to 2 rows: buckets (16, 64) and (2, 64).
# V4.1: the decode bucket only (prompt steps run eagerly) to keep the suite fast; V4.1's compiled
# prompt-as-decode path runs in examples/neuron/run_deepinfer_tiny.py.
SPEC = {"v4": BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16),
        "v41": BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None)}
BUCKETS = {"v4": {(16, 64), (2, 64)}, "v41": {(2, 64)}}
HOST = NeuronPlatform(host=True)
TOP = 2   # graphs a bucket adds for the step's entry and exit regions (regions.TOP_REGIONS)


@pytest.fixture(scope="module")
def regions():
    torch._dynamo.reset()
    return {"v4": RegionRunner("aot_eager"), "v41": RegionRunner("aot_eager")}


def _kinds(model) -> int:
    return len({layer_kind(layer) for layer in model.layers})


def _logits(kind, model, runner_kw, steps=5, kv_cache_mode="plain"):
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC[kind], kv_cache_mode=kv_cache_mode,
             **runner_kw)
    out, sizes = [], {0: len(PROMPTS[0]), 1: len(PROMPTS[1])}
    for _ in range(steps):
        logits = s.step(sizes)
        out.append(logits)
        for row, i in enumerate(sizes):
            s.tokens[i].append(int(logits[row].argmax()))
        sizes = {0: 1, 1: 1}
    return torch.cat(out), s.strategy


@pytest.mark.parametrize("kind,layers", [("v4", 6), ("v41", 8)])
def test_compiled_regions_equal_eager(regions, kind, layers):
    model = tiny_model(tiny_config(kind, layers), HOST)
    before = counters["stats"]["unique_graphs"]
    compiled, runner = _logits(kind, model, dict(regions=regions[kind]))
    eager, _ = _logits(kind, model, dict(compile=False))
    assert (compiled - eager).abs().max().item() < 1e-4
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    kinds = _kinds(model)
    assert regions[kind].num_kinds == kinds <= layers   # V4, 6 layers: 5 kinds; V4.1, 8 layers: 8
    # one graph per (bucket, layer kind), counted by Dynamo itself
    assert runner.buckets_seen == BUCKETS[kind]
    n = len(BUCKETS[kind]) * (kinds + TOP)
    assert regions[kind].stats.total_graphs == n == counters["stats"]["unique_graphs"] - before
    assert not regions[kind].stats.fp8_sites and not regions[kind].stats.float8_sites


def test_compact_kv_records_compile_into_regions():
    """DeepSeek's fp8 / fp4 KV records are encoded and decoded inside the layer regions: no host read
    (their power-of-two scales are not re-checked there), same logits as eager."""
    model = tiny_model(tiny_config("v4"), HOST)
    compiled, runner = _logits("v4", model, dict(regions=RegionRunner("aot_eager")), kv_cache_mode="compact")
    eager, _ = _logits("v4", model, dict(compile=False), kv_cache_mode="compact")
    assert runner.eager_steps == 0 and runner.num_graphs == len(BUCKETS["v4"]) * (_kinds(model) + TOP)
    assert runner.regions.stats.float8_sites == []   # the record codecs are uint8 custom ops
    assert (compiled - eager).abs().max().item() < 1e-4


def test_warm_up_compiles_every_bucket_before_the_first_request():
    """warm_up builds each (bucket, layer kind) graph from placeholder rows: nothing outside slot 0 /
    block 0 is written, and the real steps that follow compile nothing more and match eager."""
    model = tiny_model(tiny_config("v4"), HOST)
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC["v4"], regions=RegionRunner("aot_eager"))
    assert s.runner.warm_up() == len(BUCKETS["v4"]) * (_kinds(model) + TOP)
    stores = [(f"swa{k}", t, 5) for k, t in s.cache.swa.items()] + \
        [(f"entries{k}", t, 48) for k, t in s.cache.entries.items()]
    for name, t, owners in stores:   # 5 state slots / 48 blocks; slot 0 and block 0 are scratch
        per = t.shape[0] // owners
        assert (t[per:] == 0).all() and (t[:per] != 0).any(), name
    graphs = s.runner.num_graphs
    eager = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC["v4"], compile=False)
    with torch.inference_mode():   # steps run as the engine's Worker.execute runs them
        run_in_lockstep(s, eager, 5)
    assert s.runner.num_graphs == graphs and s.strategy.eager_steps == 0


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_graph_count_does_not_grow_with_layers(regions, kind):
    """12-layer models have the 6-layer V4 / 8-layer V4.1 models' layer kinds (extra V4 layers alternate
    CSA/HCA, extra V4.1 layers share layer 7 as layer 6 shares layer 5): they run on the graphs already
    built, so no guard depends on a layer index or on the model object."""
    model = tiny_model(tiny_config(kind, 12), HOST, seed=1)
    assert _kinds(model) == regions[kind].num_kinds > 0
    before, graphs = counters["stats"]["unique_graphs"], regions[kind].stats.total_graphs
    compiled, _ = _logits(kind, model, dict(regions=regions[kind]), steps=3)
    eager, _ = _logits(kind, model, dict(compile=False), steps=3)
    assert (compiled - eager).abs().max().item() < 1e-4
    assert counters["stats"]["unique_graphs"] == before
    assert regions[kind].stats.total_graphs == graphs == len(BUCKETS[kind]) * (regions[kind].num_kinds + TOP)


def test_split_regions_run_a_prompt_as_a_decode_shaped_step():
    """DEEPINFER_NEURON_REGION_SPLIT=always: projections, indexer + attention and MoE as three graphs
    per kind; a prompt chunk padded to the prefill bucket runs through the same regions as
    decode-layout rows."""
    model = tiny_model(tiny_config("v4", 2), HOST)
    split = RegionRunner("aot_eager", split="always")
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC["v4"], regions=split)
    ref = Seqs(model, EagerStrategy, PROMPTS)
    sizes = {0: len(PROMPTS[0]), 1: len(PROMPTS[1])}
    got, want = s.step(sizes), ref.step(sizes)
    assert (got - want).abs().max().item() < 1e-4
    assert split.stats.total_graphs == 3 * _kinds(model) + TOP and s.strategy.buckets_seen == {(16, 64)}


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_host_mode_gives_cpu_tokens_on_tiny_checkpoint(request, regions, kind):
    ckpt = request.getfixturevalue("tiny_v4_dir" if kind == "v4" else "tiny_v41_dir")
    cfg = ModelConfig.from_pretrained(ckpt)
    cpu = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=CpuPlatform())
    host = tiny_model(cfg, HOST, like=cpu)
    golden = Seqs(cpu, EagerStrategy, PROMPTS).greedy(6)
    graphs = regions[kind].stats.total_graphs
    s = Seqs(host, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC[kind], regions=regions[kind])
    assert s.greedy(6) == golden
    assert s.strategy.buckets_seen == BUCKETS[kind]
    # the checkpoint model has the random models' layer kinds and shapes: no new graphs
    assert regions[kind].stats.total_graphs == graphs > 0


def test_fp8_guard_runs_with_compiled_regions_and_reports_nothing(regions, monkeypatch):
    """DEEPINFER_NEURON_FP8_GUARD=1: eager code runs under the guard, regions outside it (no retrace)."""
    model = tiny_model(tiny_config("v4", 6), HOST, seed=2)
    plain = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC["v4"], regions=regions["v4"])
    want = plain.greedy(3)
    graphs = regions["v4"].stats.total_graphs
    monkeypatch.setenv("DEEPINFER_NEURON_FP8_GUARD", "1")
    guarded = NeuronPlatform(host=True)
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=guarded, buckets=SPEC["v4"], regions=regions["v4"])
    assert s.greedy(3) == want
    assert s.strategy.fp8_guard is not None and s.strategy.fp8_sites() == []
    assert regions["v4"].stats.total_graphs == graphs


def test_int64_constants_outside_int32_are_flagged():
    """docs/neuron.md §4 A4/A5: such constants are narrowed (or rejected) by neuronx-cc; the scan names them."""
    from deepinfer.neuron_ops.regions import int64_constant_sites
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x):
        return torch.where(x > 0, x, torch.full_like(x, torch.iinfo(torch.long).max)) + (x < 129280).long()

    f(torch.tensor([1, -2]))
    assert int64_constant_sites(graphs[0]) == [f"full_like({torch.iinfo(torch.long).max})"]


def test_a_step_wanting_more_logits_rows_than_the_exit_holds_runs_its_exit_eagerly(regions):
    """Prompt logprobs: a chunk scoring all its 11 tokens wants more rows than the prefill bucket's
    compiled exit (one a sequence, compile_plan.exit_logits_rows): the exit runs eagerly, the rows
    equal eager, and no graph is added."""
    import dataclasses
    model = tiny_model(tiny_config("v4", 6), HOST)
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=SPEC["v4"], regions=regions["v4"])
    ref = Seqs(model, EagerStrategy, PROMPTS)
    s.step({0: 3})   # the prompt bucket's graphs, compiled by a plain step
    ref.step({0: 3})
    graphs = regions["v4"].stats.total_graphs
    got, want = (x.runner.run([dataclasses.replace(x.chunk(0, 8), num_logits=8)]).logits for x in (s, ref))
    assert got.shape == want.shape == (8, model.cfg.vocab_size)
    assert (got - want).abs().max().item() < 1e-4
    assert regions["v4"].stats.total_graphs == graphs
