"""The compile budget (docs/neuron.md §5.10): the graphs a Neuron engine compiles, counted before it
compiles (from the config alone for V4.1-Flash), warm-up compiling exactly those, the split policy
(multi-row steps as sub-regions, decode whole) keeping greedy tokens, and the compile cache directory."""
import json
import logging
from pathlib import Path

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.engine_config import EngineConfig
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops.regions import SUB_REGIONS, RegionRunner, layer_kind
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.buckets import batch_buckets
from deepinfer.platforms.neuron.compile_plan import compile_plan, config_layer_kinds
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.runners.eager import EagerStrategy
from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs, tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[2]
V41_FLASH = ROOT / "examples" / "configs" / "v41-flash.json"
PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
BUCKET_ENV = ("DEEPINFER_NEURON_ROW_BUCKETS", "DEEPINFER_NEURON_CTX_BUCKETS", "DEEPINFER_NEURON_PREFILL_BUCKET",
              "DEEPINFER_NEURON_REGION_SPLIT", "DEEPINFER_NEURON_VERIFY_ROWS")


@pytest.fixture
def defaults(monkeypatch):
    for name in BUCKET_ENV:
        monkeypatch.delenv(name, raising=False)


def _v41_flash():
    return ModelConfig.from_dict(json.loads(V41_FLASH.read_text()))


def _default_plan(cfg, **engine):
    ec = EngineConfig(model="unused", **engine)
    ec.resolve(cfg)
    p = NeuronPlatform(host=True)
    p.validate_config(ec, cfg)
    return compile_plan(p.bucket_spec(ec), config_layer_kinds(cfg), p.region_split, drafts=ec.num_speculative_tokens)


def test_default_v41_flash_serving_config_compiles_at_most_64_graphs(defaults):
    """EngineConfig defaults (64 sequences, 2048-token steps, max_model_len 4096): 11 layer kinds over
    40 layers, rows 8 and 64 whole, one 2048-token prompt bucket in three sub-regions, one context,
    and each bucket's entry and exit graphs (the model's top level)."""
    cfg = _v41_flash()
    plan = _default_plan(cfg)
    assert plan.graph_count == 55 + 6 <= 64
    assert len(plan.kinds) == 11 and sum(plan.layers_per_kind) == cfg.num_layers == 40
    assert plan.counts("step") == {"decode": 22 + 4, "prefill": 33 + 2}
    assert plan.counts("region") == {"attention": 11, "ffn": 11, "layer": 22, "projections": 11, "entry": 3,
                                     "exit": 3}
    assert [(b["step"], b["tokens"], b["context"], b["regions"]) for b in plan.buckets()] == [
        ("decode", 8, 4096, ["entry", "layer", "exit"]), ("decode", 64, 4096, ["entry", "layer", "exit"]),
        ("prefill", 2048, 4096, ["entry", *SUB_REGIONS, "exit"])]
    assert json.loads(json.dumps(plan.to_dict()))["graph_count"] == 61
    # the buckets the default no longer compiles: every power-of-two row count and context
    ladder = BucketSpec(batch=batch_buckets(64), contexts=None, prefill_tokens=(2048,), max_model_len=4096)
    # (+ an entry graph a bucket, an exit graph a token count)
    assert compile_plan(ladder, config_layer_kinds(cfg), "never").counts("region") == {"layer": 616, "entry": 56, "exit": 8}
    # speculative decoding (nextn 5) adds two draft-block graphs and the 8-row verification bucket's
    # acceptance-and-draft graph (spec/greedy_step.py) and nothing else: the 8-row verification
    # bucket (8 x 6 = 48 tokens, padded to 64) runs one region a layer (split policy "prompt") and so
    # shares every graph of the 64-row decode bucket; more verification rows run in the prompt bucket
    spec = _default_plan(cfg, num_speculative_tokens=5)
    assert spec.spec.verify_batch == (8,) and spec.spec.verify_bucket_tokens(8) == 64
    assert spec.counts("step") == {"decode": 26, "prefill": 35, "draft": 3}
    assert spec.counts("region")["verify_draft"] == 1
    assert spec.graph_count == 64 <= 64
    # the draft block of 8 and of 64 rows x 5 tokens, padded to powers of two (§4 B3)
    assert [b["tokens"] for b in spec.buckets() if b["step"] == "draft"] == [64, 512]


def test_verification_buckets_of_more_rows_and_split_verification_are_options(defaults, monkeypatch):
    """DEEPINFER_NEURON_VERIFY_ROWS gives the 64-row bucket its own 512-token verification bucket (13
    whole-layer graphs); DEEPINFER_NEURON_REGION_SPLIT=multi_row splits verification steps as well,
    the plan before the default changed (131 graphs then, 133 with the verify_draft graphs)."""
    cfg = _v41_flash()
    monkeypatch.setenv("DEEPINFER_NEURON_VERIFY_ROWS", "8,64")
    plan = _default_plan(cfg, num_speculative_tokens=5)
    # (+ a verify_draft graph a verification row bucket)
    assert plan.counts("step") == {"decode": 26, "prefill": 35, "verify": 11 + 2, "draft": 2 + 2}
    monkeypatch.setenv("DEEPINFER_NEURON_REGION_SPLIT", "multi_row")
    plan = _default_plan(cfg, num_speculative_tokens=5)
    assert plan.counts("step") == {"decode": 26, "prefill": 35, "verify": 66 + 2, "draft": 2 + 2}
    assert plan.graph_count == 133
    monkeypatch.setenv("DEEPINFER_NEURON_VERIFY_ROWS", "8,16")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_VERIFY_ROWS"):
        _default_plan(cfg, num_speculative_tokens=5)


def _plan_at(cfg, kinds, **engine):
    ec = EngineConfig(model="unused", **engine)
    ec.resolve(cfg)
    p = NeuronPlatform(host=True)
    p.validate_config(ec, cfg)
    return compile_plan(p.bucket_spec(ec), kinds, p.region_split, drafts=ec.num_speculative_tokens)


@pytest.mark.parametrize("engine", [{}, {"max_num_seqs": 6, "max_num_batched_tokens": 1000}])
def test_every_planned_step_has_a_power_of_two_token_count_at_nextn_1_to_5(defaults, engine):
    """Verification steps of rows x (1 + nextn) tokens, draft blocks of rows x nextn tokens and prompt
    buckets pad to powers of two (§4 B3). The verification bucket is the 8-row one, its tokens rounded up
    to a decode bucket's that holds them (64 at the defaults, at every nextn: 64 graphs with its verify_draft graph); it runs one
    region a layer, so 13 graphs (11 layer kinds, entry, exit) where no decode bucket holds it."""
    cfg = _v41_flash()
    kinds = config_layer_kinds(cfg)
    for nextn in range(1, 6):
        plan = _plan_at(cfg, kinds, num_speculative_tokens=nextn, **engine)
        tokens = [b["tokens"] for b in plan.buckets()]
        assert all(t & (t - 1) == 0 for t in tokens), (nextn, tokens)
        assert plan.spec.verify_batch == (8,)
        verify = plan.spec.verify_bucket_tokens(8)
        assert verify == (1 << (8 * (1 + nextn) - 1).bit_length() if engine else 64)
        decode = {b["tokens"] for b in plan.buckets() if b["step"] == "decode"}
        assert plan.counts("step").get("verify", 0) == (0 if verify in decode else 13), (nextn, plan.counts("step"))
        assert plan.graph_count == (63 if engine else 64), nextn
        drafts = [b["tokens"] for b in plan.buckets() if b["step"] == "draft"]
        assert drafts == [1 << (r * nextn - 1).bit_length() for r in plan.spec.batch], (nextn, drafts)
    # 1000-token steps: one 1024-token prompt bucket
    assert [b["tokens"] for b in plan.buckets() if b["step"] == "prefill"] == [1024 if engine else 2048]


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_config_layer_kinds_equal_the_built_models(kind):
    """The plan's kinds come from the config alone; the model built from it has exactly those."""
    cfg = tiny_config(kind, 12)
    model = tiny_model(cfg, NeuronPlatform(host=True))
    assert config_layer_kinds(cfg) == [layer_kind(layer) for layer in model.layers]


def test_v41_flash_config_kinds_are_computed_without_building_the_model():
    kinds = config_layer_kinds(_v41_flash())
    assert len(kinds) == 40 and len(set(kinds)) == 11
    # layers 22-25 (YOCO consumers of layer 20's entries, not targets) share one graph
    assert len({kinds[i] for i in (21, 22, 23, 24, 25)}) == 1 and kinds[26] != kinds[25]


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_warm_up_compiles_the_plan_and_the_split_keeps_greedy_tokens(request, kind, caplog):
    """multi_row: the prompt step runs as projections | indexer + attention | MoE, decode steps one
    region a layer; warm-up compiles exactly the logged plan, the real steps compile nothing more and
    give the CPU platform's greedy tokens on the tiny checkpoint."""
    ckpt = request.getfixturevalue("tiny_v4_dir" if kind == "v4" else "tiny_v41_dir")
    cfg = ModelConfig.from_pretrained(ckpt)
    cpu = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=CpuPlatform())
    golden = Seqs(cpu, EagerStrategy, PROMPTS).greedy(4)
    host = NeuronPlatform(host=True)
    model = tiny_model(cfg, host, like=cpu)
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16)
    regions = RegionRunner("aot_eager", split="multi_row")
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=host, buckets=spec, regions=regions)
        plan = s.strategy.plan
        assert f"{plan.graph_count} region graphs to compile" in caplog.text
        assert s.runner.warm_up() == plan.graph_count
    kinds = regions.num_kinds
    assert plan.graph_count == kinds * (1 + len(SUB_REGIONS)) + 2 * 2   # + entry and exit of both buckets
    assert dict(regions.stats.regions) == {"layer": kinds, **{r: kinds for r in SUB_REGIONS}, "entry": 2, "exit": 2}
    assert f"warm-up: {plan.graph_count} of the {plan.graph_count} planned region graphs" in caplog.text
    assert s.greedy(4) == golden
    assert regions.stats.total_graphs == plan.graph_count and s.strategy.eager_steps == 0


def test_never_and_always_policies():
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16)
    kinds = [("a",), ("b",), ("a",)]
    top = {"entry": 2, "exit": 2}
    assert compile_plan(spec, kinds, "never").counts("region") == {"layer": 4, **top}
    assert compile_plan(spec, kinds, "always").counts("region") == {**{r: 4 for r in SUB_REGIONS}, **top}
    with pytest.raises(ValueError, match="multi_row"):
        RegionRunner("aot_eager", split="sometimes")


def test_step_scope_plans_one_graph_a_bucket():
    """The cpu platform's "step" compile scope: a bucket is one graph whatever its layer kinds and split;
    the draft and verify_draft graphs stay as they are."""
    spec = BucketSpec(batch=(1, 2), contexts=(64,), prefill_tokens=None, verify_tokens=3)
    kinds = [("a",), ("b",), ("a",)]
    layer = compile_plan(spec, kinds, "never", drafts=2)
    step = compile_plan(spec, kinds, "never", drafts=2, scope="step")
    buckets = len({(g.tokens, g.context) for g in layer.graphs if g.region == "entry"})
    assert step.counts("region") == {"step": buckets, "draft": 2, "verify_draft": 2}
    assert layer.counts("region") == {"layer": 2 * buckets, "entry": buckets, "exit": buckets, "draft": 2,
                                      "verify_draft": 2}
    with pytest.raises(ValueError, match="layer|step"):
        compile_plan(spec, kinds, "never", scope="model")
    with pytest.raises(ValueError, match="layer|step"):
        RegionRunner("aot_eager", scope="model")


def test_plan_script_prints_and_writes_the_v41_flash_plan(defaults, tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("compile_plan_script", ROOT / "examples/neuron/compile_plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "plan.json"
    assert script.main(["--config", str(V41_FLASH), "--nextn", "5", "--json", str(out)]) == 0
    assert "64 region graphs to compile" in capsys.readouterr().out
    assert json.loads(out.read_text())["by_step"] == {"decode": 26, "draft": 3, "prefill": 35}
