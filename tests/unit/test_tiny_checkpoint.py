"""Tiny checkpoints (docs/model.md §7): layout, formats, counts (from the checkpoint schema), loading, and
transformers on the V4 one."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.config import ModelConfig
from deepinfer.model_executor import checkpoint_schema as cs
from deepinfer.model_executor import tiny_checkpoint as tc
from deepinfer.model_executor.loader import load_weights

from tests.support import load_script



def _headers(d: Path) -> dict[str, tuple[str, tuple, str]]:
    """name -> (safetensors dtype, shape, file) for every stored tensor."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()), f.name)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return tc.make_tiny_checkpoint("v41", tmp_path_factory.mktemp("v41"), seed=0, shards=2)


@pytest.fixture(scope="module")
def v4u_dir(tmp_path_factory):
    return tc.make_tiny_checkpoint("v4", tmp_path_factory.mktemp("v4u"), seed=0, unquantized=True)


@pytest.fixture(scope="module")
def v4q_dir(tmp_path_factory):
    """The fp8 V4 variant, written through the command line script."""
    cli = load_script("examples/tools/make_tiny_checkpoint.py")
    out = tmp_path_factory.mktemp("v4q")
    assert cli.main(["--kind", "v4", "--out", str(out), "--seed", "0"]) == 0
    return out


def test_v41_files_and_config(v41_dir):
    raw = json.loads((v41_dir / "config.json").read_text())
    assert raw == json.loads(json.dumps(tc.v41_tiny_config()))
    assert sorted(p.name for p in v41_dir.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                      "model-00002-of-00002.safetensors"]
    pkg = tc._tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (v41_dir / f).read_bytes() == (pkg / f).read_bytes()
    gen = json.loads((v41_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 1, 2)
    index = json.loads((v41_dir / "model.safetensors.index.json").read_text())
    heads = _headers(v41_dir)
    assert set(index["weight_map"]) == set(heads)
    assert all(index["weight_map"][k] == f for k, (_, _, f) in heads.items())
    for k in heads:  # a weight and its scale share a shard
        if k.endswith(".scale"):
            assert heads[k][2] == heads[k[: -len(".scale")] + ".weight"][2], k


def test_v41_parameter_counts():
    cfg = ModelConfig.from_dict(tc.v41_tiny_config())
    shapes = cs.tensor_shapes(cfg)
    backbone = sum(math.prod(s) for k, s in shapes.items() if not k.startswith("mtp."))
    assert backbone == 77_547_344  # docs/model.md §7.2
    assert cs.count_parameters(cfg) == 87_398_516
    assert cs.engram_table_primes(cfg) == {1: [[1009, 1013], [1019, 1021]], 3: [[1031, 1033], [1039, 1049]]}
    assert cs.engram_table_rows(cfg) == {1: 4062, 3: 4152}


def test_v4_parameter_count():
    cfg = ModelConfig.from_dict(tc.v4_tiny_config())
    assert cs.count_parameters(cfg, include_buffers=False) == 73_432_545  # docs/model.md §7.1 (TF count)
    assert cs.count_parameters(cfg) == 73_432_545 + 4 * 8  # + gate.bias of the 4 non-hash layers


def test_v41_storage_formats(v41_dir):
    h = _headers(v41_dir)
    assert h["embed.weight"][:2] == ("BF16", (129280, 256)) and h["head.weight"][0] == "BF16"
    assert h["layers.2.attn.wq_a.weight"][:2] == ("F8_E4M3", (64, 256))
    assert h["layers.2.attn.wq_a.scale"][:2] == ("F8_E8M0", (2, 8))  # 32x32 blocks
    assert h["layers.2.attn.wo_a.scale"][1] == (4, 8)
    assert h["layers.0.ffn.experts.7.w2.weight"][:2] == ("I8", (256, 64))  # fp4 packed [D, I/2]
    assert h["layers.0.ffn.experts.7.w2.scale"][:2] == ("F8_E8M0", (256, 4))  # one per 32 inputs
    assert h["layers.0.ffn.shared_experts.w1.weight"][0] == "F8_E4M3"
    assert h["layers.1.engram.embed.weight"][:2] == ("F8_E4M3", (4062, 128))
    assert h["layers.1.engram.embed.scale"][:2] == ("F8_E8M0", (4062, 4))
    assert h["layers.3.engram.wkv.weight"][:2] == ("F8_E4M3", (1280, 512))
    assert h["layers.3.engram.q_weight"][:2] == ("BF16", (4, 256))
    for name in ("layers.0.hc_attn_fn", "layers.0.hc_ffn_scale", "layers.4.attn.attn_sink", "layers.4.ffn.gate.bias",
                 "layers.4.ffn.gate.bias_vl", "mtp.1.hc_attn_base"):
        assert h[name][0] == "F32", name
    for name in ("layers.2.attn.compressor.wgate.weight", "layers.2.attn.indexer.weights_proj.weight",
                 "layers.2.attn.indexer.wk.weight", "layers.7.attn.kv_norm.weight", "layers.0.ffn.gate.weight",
                 "mtp.1.markov_head.embed.weight", "mtp.1.confidence_head.proj.weight"):
        assert h[name][0] == "BF16", name
    assert h["mtp.0.main_proj.weight"][:2] == ("F8_E4M3", (256, 768))
    assert "layers.5.attn.compressor.wgate.weight" not in h  # C1 has no gate
    assert "layers.3.attn.compressor.wkv.weight" not in h and "layers.3.attn.indexer.wq_b.weight" not in h
    assert "layers.4.attn.indexer.wq_b.weight" in h and "layers.4.attn.indexer.wk.weight" not in h
    assert "mtp.0.ffn.experts.3.w1.weight" in h and "mtp.0.ffn.experts.4.w1.weight" not in h
    assert not any(k.startswith("hc_head") for k in h)  # shifted HC has no HC head


def test_v41_loads_close_to_master_weights(v41_dir):
    cfg = ModelConfig.from_pretrained(v41_dir)
    specs = cs.expected_tensor_specs(cfg, torch.float32)
    out = load_weights(v41_dir, specs, progress=False)
    assert set(out) == set(specs)
    shapes = cs.tensor_shapes(cfg)
    bounds = {"f32": 0.0, "bf16": 0.005, "fp8": 0.04, "table": 0.04, "fp4": 0.15}
    seen = set()
    for name in shapes:
        fmt = cs.tensor_format(cfg, name)
        if fmt in seen and not name.startswith("mtp."):
            continue  # one tensor per format, plus the draft layers
        seen.add(fmt)
        ref = tc.dense_value(cfg, name, shapes[name], 0)
        assert out[name].shape == ref.shape
        assert _rel(out[name], ref) <= bounds[fmt], (name, fmt)
    assert seen == set(bounds)
    # the values are sane: non-trivial HC base/scale, sink, bias_vl, norm weights near 1
    assert out["layers.0.hc_attn_base"].abs().mean() > 0.1 and out["mtp.0.ffn.gate.bias_vl"].abs().sum() > 0
    assert (out["layers.0.attn_norm.weight"] - 1).abs().max() < 0.6


def test_v4_fp8_variant_matches_unquantized(v4q_dir, v4u_dir):
    cfg_q, cfg_u = ModelConfig.from_pretrained(v4q_dir), ModelConfig.from_pretrained(v4u_dir)
    assert cfg_q.quant == {"weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert cfg_u.quant is None and cfg_u.torch_dtype == torch.float32
    h = _headers(v4q_dir)
    assert h["layers.1.attn.wq_a.scale"][:2] == ("F8_E8M0", (1, 2))  # [64, 256] in 128x128 blocks
    assert h["layers.1.attn.indexer.wq_b.scale"][1] == (4, 1)
    assert h["layers.0.ffn.gate.tid2eid"][:2] == ("I32", (129280, 2))
    assert h["layers.1.attn.compressor.ape"][0] == "F32" and h["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    assert _headers(v4u_dir)["layers.0.ffn.gate.tid2eid"][0] == "I64"
    specs = cs.expected_tensor_specs(cfg_q, torch.float32)
    q = load_weights(v4q_dir, specs, progress=False)
    u = load_weights(v4u_dir, specs, progress=False)
    assert torch.equal(q["layers.0.ffn.gate.tid2eid"], u["layers.0.ffn.gate.tid2eid"])
    tid = u["layers.1.ffn.gate.tid2eid"]
    assert tid.min() >= 0 and tid.max() < 8 and (tid[:, 0] != tid[:, 1]).all()  # distinct experts per token
    for name in ("layers.2.attn.wq_a.weight", "layers.3.attn.indexer.wq_b.weight",
                 "layers.4.ffn.shared_experts.w2.weight"):
        assert _rel(q[name], u[name]) < 0.04, name
    assert _rel(q["layers.2.ffn.experts.3.w1.weight"], u["layers.2.ffn.experts.3.w1.weight"]) < 0.15
    assert torch.equal(q["layers.2.hc_ffn_fn"], u["layers.2.hc_ffn_fn"])


def test_values_are_deterministic_per_seed():
    cfg = ModelConfig.from_dict(tc.v41_tiny_config())
    a = tc.dense_value(cfg, "layers.2.attn.wq_a.weight", (64, 256), 0)
    assert torch.equal(a, tc.dense_value(cfg, "layers.2.attn.wq_a.weight", (64, 256), 0))
    assert not torch.equal(a, tc.dense_value(cfg, "layers.2.attn.wq_a.weight", (64, 256), 1))
    assert not torch.equal(a, tc.dense_value(cfg, "layers.3.attn.wq_a.weight", (64, 256), 0))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        tc.make_tiny_checkpoint("v5", tmp_path)
    with pytest.raises(ValueError, match="shards"):
        tc.make_tiny_checkpoint("v4", tmp_path, shards=0)
    with pytest.raises(ValueError, match="unquantized"):
        tc.make_tiny_checkpoint("v41", tmp_path, unquantized=True)
    with pytest.raises(ValueError, match="layers"):
        tc.make_tiny_checkpoint("v41", tmp_path, layers=0)
    assert not list(tmp_path.iterdir())


def test_transformers_loads_v4_without_missing_keys(v4u_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(v4u_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert model.num_parameters() == 73_432_545
    tok = transformers.AutoTokenizer.from_pretrained(v4u_dir)
    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    argmax = []
    with torch.no_grad():
        for p in prompts:
            logits = model(tok(p, return_tensors="pt").input_ids).logits[0]
            assert torch.isfinite(logits).all()
            assert 0.5 < logits.std(-1).mean() < 10
            argmax.append(logits.argmax(-1))
    assert argmax[0][-1] != argmax[1][-1] and len(set(argmax[1].tolist())) > 3
    # transformers' own names (its state_dict) load through the §2.3 mapping to the same tensors
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(v4u_dir)
    specs = cs.expected_tensor_specs(cfg, torch.float32)
    from_tf = load_weights(tmp_path, specs, progress=False)
    official = load_weights(v4u_dir, specs, progress=False)
    for name in specs:
        assert torch.equal(from_tf[name], official[name]), name
