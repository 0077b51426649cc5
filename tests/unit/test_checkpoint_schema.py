"""The checkpoint schema (model_executor/checkpoint_schema.py): read off the meta-built model, with the
stored formats its modules declare, and consistent with the name rules that code without a model
applies (model_executor/checkpoint_formats.py: the loader, the shard plan)."""
import pytest
import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.model_executor import checkpoint_schema as cs
from deepinfer.model_executor.checkpoint_formats import (BF16, DENSE, F32, FP4, FP8, INT, TABLE, is_engram_table,
                                                         is_fp32_tensor, routed_expert, stored_as)
from deepinfer.model_executor.tiny_checkpoint import v4_tiny_config, v41_tiny_config

CONFIGS = {"v41": v41_tiny_config, "v4": v4_tiny_config, "v4_fp8": lambda: v4_tiny_config(quantized=True),
           "v41_l4": lambda: v41_tiny_config(layers=4)}

# The linears upstream DeepInfer builds with use_fp8_gemm (docs/model.md §2.1), by name suffix.
FP8_SUFFIXES = {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                "ffn.shared_experts.w3.weight", "engram.wkv.weight", "main_proj.weight"}


def _suffix(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[1:] if parts[0] in ("embed", "head", "norm") else parts[2:]) if "." in name else name


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def cfg(request):
    return ModelConfig.from_dict(CONFIGS[request.param]())


def test_schema_is_the_meta_models_state_dict(cfg):
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    with torch.device("meta"):
        model = DeepseekV4Model(cfg, torch.float32)
    sd = model.state_dict()
    assert cs.tensor_shapes(cfg) == {k: tuple(v.shape) for k, v in sd.items()}


def test_declared_formats_match_the_release_layout(cfg):
    schema = cs.checkpoint_schema(cfg)
    fmts = {name: spec.stored for name, spec in schema.items()}
    assert set(fmts.values()) <= {F32, BF16, FP8, FP4, TABLE, INT}
    fp8 = {_suffix(n) for n, f in fmts.items() if f == FP8}
    want = {s for s in FP8_SUFFIXES if any(n.endswith(s) for n in schema)}
    assert fp8 == want
    for name, fmt in fmts.items():
        expert = routed_expert(name)
        assert (fmt == FP4) == (expert is not None), name       # routed experts, and only they, are fp4
        assert (fmt == TABLE) == is_engram_table(name), name
        assert (fmt == INT) == name.endswith("ffn.gate.tid2eid"), name
        # the loader's fp32 rule names exactly the tensors the model holds in fp32; the V4 compressor
        # ape is stored fp32 but computed in the model dtype
        assert is_fp32_tensor(name) == (schema[name].dtype == torch.float32), name
        assert (fmt == F32) == (is_fp32_tensor(name) or name.endswith("compressor.ape")), name


def test_unquantized_checkpoint_stores_everything_dense_but_fp32_and_int(cfg):
    for name, spec in cs.checkpoint_schema(cfg).items():
        dense = cs.tensor_format(cfg, name, quantized=False)
        assert dense == (spec.stored if spec.stored in (F32, INT) else DENSE), name


def test_expected_specs_take_the_requested_compute_dtype(cfg):
    specs = cs.expected_tensor_specs(cfg, torch.bfloat16)
    for name, (shape, dtype) in specs.items():
        want = torch.float32 if is_fp32_tensor(name) else torch.int64 if name.endswith("tid2eid") else torch.bfloat16
        assert dtype == want, name
    assert cs.expected_tensor_specs(cfg)["embed.weight"][1] == cfg.torch_dtype


def test_engram_rows_are_the_hash_layouts():
    cfg = ModelConfig.from_dict(v41_tiny_config())
    shapes = cs.tensor_shapes(cfg)
    for layer, rows in cs.engram_table_rows(cfg).items():
        assert shapes[f"layers.{layer}.engram.embed.weight"] == (rows, cfg.engram_head_dim)


def test_the_cache_hands_out_copies():
    cfg = ModelConfig.from_dict(v41_tiny_config())
    cs.checkpoint_schema(cfg).pop("embed.weight")
    assert "embed.weight" in cs.checkpoint_schema(cfg)


def test_stored_as_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        stored_as("fp6", nn.Linear(2, 2))
