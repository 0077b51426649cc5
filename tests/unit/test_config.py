"""ModelConfig parsing (both V4 spellings, V4.1 text_config) and the docs/model.md §1.3 rules."""

import copy
import dataclasses
import json

import pytest
import torch

from deepinfer.config import ModelConfig, source_map
from deepinfer.model_executor.tiny_checkpoint import v4_tiny_config, v41_tiny_config


def _norm(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d.pop("raw")
    return d


def _v41(**text_overrides):
    raw = v41_tiny_config()
    raw["text_config"].update(text_overrides)
    return raw


def _official_v4(**overrides):
    """V4 in the official spelling only: legacy compress_ratios (0/4/128, L + nextn entries)."""
    raw = {
        "model_type": "deepseek_v4", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "sliding_window": 4, "index_n_heads": 2,
        "index_head_dim": 32, "index_topk": 8, "max_position_embeddings": 512,
        "compress_ratios": [128, 4, 0, 4, 0], "num_hash_layers": 1, "num_nextn_predict_layers": 1,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1},
        "bos_token_id": 0, "eos_token_id": [1, 5],
    }
    raw.update(overrides)
    return raw


def test_v41_tiny_attributes():
    c = ModelConfig.from_dict(v41_tiny_config())
    assert c.is_v41 and c.model_type == "deepseek_v41"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.head_dim, c.rope_dim) == (8, 256, 4, 128, 64)
    assert c.compress_ratios == [0, 0, 2, 2, 2, 1, 1, 1]
    assert c.layer_kinds == ["swa", "swa", "c2", "c2", "c2", "c1", "c1", "c1"]
    assert c.kv_source_map == [0, 1, 2, 2, 2, 5, 5, 7]
    assert c.index_source_map == [0, 1, 2, 2, 4, 5, 5, 7]
    assert c.index_k_source_map == c.kv_source_map and c.index_k_source_layer_ids == [2, 5, 7]
    assert c.n_prefill_layer == 5 and c.hc_shifted and c.hash_moe == [False] * 8
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (5, 8, 8)
    assert c.engram_layer_ids == [1, 3] and c.engram_compressed_vocab and c.engram_pad_token_id == 2
    assert (c.engram_max_ngram_size, c.engram_vocab_size, c.engram_n_heads, c.engram_head_dim) == (3, 1009, 2, 128)
    assert c.num_nextn_predict_layers == 2 and c.dspark_target_layer_ids == [1, 4, 7]
    assert (c.dspark_n_routed_experts, c.dspark_num_experts_per_tok, c.dspark_markov_rank) == (4, 2, 32)
    assert c.rope_scaling == {"factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
                              "beta_slow": 1.0}
    assert c.torch_dtype == torch.bfloat16 and c.eos_token_ids == [1] and (c.bos_token_id, c.pad_token_id) == (0, 2)
    assert c.quant == {"weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert c.raw["text_config"]["hidden_size"] == 256


def test_v4_official_keys():
    c = ModelConfig.from_dict(_official_v4())
    assert not c.is_v41
    assert c.compress_ratios == [128, 4, 0, 4]  # the nextn entry is dropped
    assert c.layer_kinds == ["hca", "csa", "swa", "csa"]
    assert c.hash_moe == [True, False, False, False]
    assert c.rope_dim == 16 and not c.hc_shifted and c.eos_token_ids == [1, 5]
    assert c.rope_scaling["factor"] == 4.0 and c.n_prefill_layer == 4 and c.kv_source_map == []
    assert c.num_nextn_predict_layers == 1 and c.quant is None


def test_v4_transformers_keys_give_the_same_config():
    official = ModelConfig.from_dict(_official_v4())
    tf = _official_v4()
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "rope_theta",
              "compress_rope_theta"):
        tf.pop(k)
    tf.update({
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4,
                                         "original_max_position_embeddings": 128, "beta_fast": 32,
                                         "beta_slow": 1, "attention_factor": 1.0}},
    })
    assert _norm(ModelConfig.from_dict(tf)) == _norm(official)
    flat = copy.deepcopy(tf)  # TF also accepts a flat YaRN block as rope_parameters
    flat["rope_parameters"] = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 128}
    flat.update(rope_theta=10000.0, compress_rope_theta=160000.0)
    assert _norm(ModelConfig.from_dict(flat)) == _norm(official)


def test_v4_transformers_to_dict_round_trip():
    transformers = pytest.importorskip("transformers")
    raw = v4_tiny_config()
    tf = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert _norm(ModelConfig.from_dict(tf.to_dict())) == _norm(ModelConfig.from_dict(raw))


def test_v4_defaults_follow_transformers():
    raw = _official_v4()
    raw.pop("compress_ratios")
    raw.pop("num_hash_layers")
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == ["hca", "hca", "hca", "csa"]  # 2 x HCA, then alternating HCA / CSA
    assert c.hash_moe == [True, True, True, False]  # default 3 hash layers


def test_from_pretrained_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_tiny_config()))
    a = ModelConfig.from_pretrained(tmp_path)
    b = ModelConfig.from_pretrained(tmp_path / "config.json")
    assert _norm(a) == _norm(b)
    with pytest.raises(ValueError, match="config.json not found"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_source_map_rule():
    assert source_map([2, 5, 7], 9) == [0, 1, 2, 2, 2, 5, 5, 7, 7]
    assert source_map([], 3) == [0, 1, 2]


def test_v41_without_ratio_one_has_no_yoco():
    c = ModelConfig.from_dict(v41_tiny_config(layers=5))
    assert c.n_prefill_layer == 5 and c.candidate_source_layer_id is None


@pytest.mark.parametrize("layers", [1, 2, 3, 6, 10])
def test_v41_tiny_layer_variants_are_valid(layers):
    c = ModelConfig.from_dict(v41_tiny_config(layers=layers))
    assert c.num_layers == layers and len(c.kv_source_map) == layers


def test_v41_large_index_topk_grows_candidate_blocks():
    c = ModelConfig.from_dict(v41_tiny_config(index_topk=512))
    assert c.candidate_topk_blocks == 64  # docs/model.md §7.2 exact-parity setting


# --- docs/model.md §1.3 and key validation: every rule raises ValueError naming the key -------------------

V41_ERRORS = [
    ({"o_groups": 3}, "o_groups"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim"),  # V4.1 indexer RoPE must be 64
    ({"index_head_dim": 32, "candidate_source_layer_id": None}, "qk_rope_head_dim"),  # r > index_head_dim
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1]}, "compress_ratios"),  # L + nextn entries
    ({"compress_ratios": [0, 0, 2, 2, 3, 1, 1, 1, 0, 0]}, "compress_ratios"),  # values 0/1/2
    ({"compress_ratios": [0, 0, 2, 0, 2, 1, 1, 1, 0, 0]}, r"compress_ratios\[3\]"),  # ratio 0 after a source
    ({"compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0]}, "kv_source_layer_ids"),  # 4 differs from its kv src
    ({"kv_source_layer_ids": [2, 4, 5, 7], "index_k_source_layer_ids": [2, 5, 7]},
     "index_k_source_layer_ids"),  # kv sources must be index-K sources
    ({"index_k_source_layer_ids": [2, 4, 5, 7]}, "index_k_source_layer_ids"),  # index-K must equal kv
    ({"index_source_layer_ids": [2, 5, 7], "index_k_source_layer_ids": [2, 5, 7],
      "kv_source_layer_ids": [2, 5, 7, 4]}, "index_k_source_layer_ids"),
    ({"kv_source_layer_ids": [2, 4, 7], "index_k_source_layer_ids": [2, 4, 7]}, "kv_source_layer_ids"),
    ({"kv_source_layer_ids": [0, 2, 5, 7]}, "kv_source_layer_ids"),  # ratio-0 source
    ({"kv_source_layer_ids": [2, 5, 9]}, "kv_source_layer_ids"),  # out of range
    ({"candidate_source_layer_id": 6}, "candidate_source_layer_id"),  # not an index source
    ({"candidate_source_layer_id": 4}, r"compress_ratios\[5\]"),  # later layers have another ratio
    ({"candidate_topk_blocks": 12}, "candidate_topk_blocks"),  # multiple of 8
    ({"candidate_block_size": 32}, "candidate_block_size"),
    ({"candidate_block_size": 4, "candidate_topk_blocks": 16}, "candidate_block_size"),  # 8 or 16 when filtered
    ({"index_topk": 100}, "candidate_topk_blocks"),  # capacity 8 * 8 < 100
    ({"index_n_heads": 64}, "index_n_heads"),
    ({"engram_head_dim": 100}, "engram_head_dim"),
    ({"engram_layer_ids": [1, 8]}, "engram_layer_ids"),
    ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids"),
    ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
    ({"dspark_noise_token_id": 200000}, "dspark_noise_token_id"),
    ({"dspark_target_attn_input": False}, "dspark_target_attn_input"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": "256"}, "hidden_size"),
    ({"moe_intermediate_size": 100}, "moe_intermediate_size"),  # FP8/FP4 dims must be multiples of 32
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({"rope_scaling": {"factor": 16}}, "original_max_position_embeddings"),
]


@pytest.mark.parametrize("overrides,key", V41_ERRORS)
def test_v41_rejects(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(_v41(**overrides))


def test_v41_missing_key_is_named():
    raw = v41_tiny_config()
    del raw["text_config"]["sliding_window"]
    with pytest.raises(ValueError, match="text_config.sliding_window: missing"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("top,key", [
    ({"architectures": ["A", "B"]}, "architectures"),
    ({"text_config": None}, "text_config"),
    ({"model_type": "llama"}, "model_type"),
    ({"dtype": "int8"}, "dtype"),
    ({"eos_token_id": 300000}, "eos_token_id"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32]}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "e4m3"}}, "scale_fmt"),
])
def test_v41_top_level_rejects(top, key):
    raw = v41_tiny_config()
    raw.update(top)
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("overrides,key", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"layer_types": ["sliding_attention", "csa", "sliding_attention", "sliding_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["moe"] * 5}, "mlp_layer_types"),
    ({"mlp_layer_types": ["moe", "moe", "dense", "moe"]}, "mlp_layer_types"),
    ({"compress_ratios": [128, 4, 0]}, "compress_ratios"),  # fewer than L entries
    ({"compress_ratios": [128, 16, 0, 4, 0]}, r"compress_ratios\[1\]"),  # 16 is neither CSA nor HCA rate
    ({"layer_types": ["sliding_attention"] * 4}, "compress_ratios"),  # disagrees with the legacy list
    ({"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 4}}, "compress_rates"),
    ({"compress_rates": {"bogus": 4}}, "compress_rates"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # disagrees with qk_rope_head_dim 16
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"o_groups": 3}, "o_groups"),
    ({"hc_shifted": True}, "hc_shifted"),
    ({"num_hash_layers": -1}, "num_hash_layers"),
    ({"index_topk": 0}, "index_topk"),
])
def test_v4_rejects(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(_official_v4(**overrides))


def test_v4_legacy_rates_fold_in():
    c = ModelConfig.from_dict(_official_v4(compress_ratios=[16, 4, 0, 4, 0], compress_rate_hca=16))
    assert c.layer_kinds == ["hca", "csa", "swa", "csa"] and c.compress_ratios == [16, 4, 0, 4]


def test_not_a_dict():
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_dict([1, 2])
