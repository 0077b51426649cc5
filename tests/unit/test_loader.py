"""Loader: formats, names, sharding, and every error path, on tiny hand-made checkpoints.

Expected dense values are computed here per element from the format definitions (docs/model.md §2.1),
not with deepinfer's quant module.
"""

import functools
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deepinfer.model_executor.loader import load_checkpoint, load_weights, tf_to_canonical

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def _fp8_case(gen, rows, cols, block, scale_as="ue8m0"):
    """Stored (e4m3 weight, scale) and the per-element expected dense value."""
    q = torch.randint(-8, 9, (rows, cols), generator=gen).float()  # small integers are exact in e4m3
    sr, sc = -(-rows // block), -(-cols // block)
    exps = torch.randint(-6, 7, (sr, sc), generator=gen)
    dense = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            dense[i, j] = q[i, j].item() * 2.0 ** exps[i // block, j // block].item()
    if scale_as == "ue8m0":
        scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = torch.pow(2.0, exps.float())
    return q.to(torch.float8_e4m3fn), scale, dense


def _fp4_case(gen, rows, cols):
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int8)
    exps = torch.randint(-4, 5, (rows, cols // 32), generator=gen)
    dense = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            byte = int(packed[i, j // 2]) & 0xFF
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            dense[i, j] = _e2m1(code) * 2.0 ** exps[i, j // 32].item()
    return packed, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu), dense


@functools.lru_cache(maxsize=1)
def _build_case():
    g = torch.Generator().manual_seed(0)
    stored, dense = {}, {}
    dense["embed.weight"] = torch.randn(8, 4, generator=g).to(BF16).float()
    stored["model.embed.weight"] = dense["embed.weight"].to(BF16)  # optional `model.` prefix
    dense["norm.weight"] = torch.randn(4, generator=g)
    stored["norm.weight"] = dense["norm.weight"]
    dense["layers.0.hc_attn_fn"] = torch.randn(3, 4, generator=g)
    stored["layers.0.hc_attn_fn"] = dense["layers.0.hc_attn_fn"]
    dense["layers.0.attn.attn_sink"] = torch.randn(2, generator=g)
    stored["layers.0.attn.attn_sink"] = dense["layers.0.attn.attn_sink"]
    q, s, d = _fp8_case(g, 40, 70, 32)
    stored["layers.0.attn.wq_a.weight"], stored["layers.0.attn.wq_a.scale"] = q, s
    dense["layers.0.attn.wq_a.weight"] = d
    q, s, d = _fp8_case(g, 64, 256, 128, scale_as="f32")  # DeepSeek-V3 style weight_scale_inv
    stored["layers.0.attn.wkv.weight"], stored["layers.0.attn.wkv.weight_scale_inv"] = q, s
    dense["layers.0.attn.wkv.weight"] = d
    p, s, d = _fp4_case(g, 4, 64)
    stored["layers.0.ffn.experts.0.w1.weight"], stored["layers.0.ffn.experts.0.w1.scale"] = p, s
    dense["layers.0.ffn.experts.0.w1.weight"] = d
    tid = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    stored["layers.0.ffn.gate.tid2eid"] = tid
    dense["layers.0.ffn.gate.tid2eid"] = tid.long()
    q, s, d = _fp8_case(g, 7, 64, 1)  # Engram table: 7 stored rows, 1x32 blocks
    s = s.view(torch.uint8)[:, ::32][:, :2].contiguous().view(torch.float8_e8m0fnu)
    d = q.float() * torch.pow(2.0, s.view(torch.uint8).float() - 127).repeat_interleave(32, dim=1)
    stored["layers.0.engram.embed.weight"], stored["layers.0.engram.embed.scale"] = q, s
    dense["layers.0.engram.embed.weight"] = torch.cat([d, torch.zeros(3, 64)])  # model has 10 rows
    stored["vision.patch_embed.weight"] = torch.ones(2, 2)  # ignored
    stored["aligner.w1.weight"] = torch.ones(2)
    stored["image_newline"] = torch.ones(2)
    expected = {k: (tuple(v.shape), v.dtype if not v.is_floating_point() else F32) for k, v in dense.items()}
    expected["embed.weight"] = ((8, 4), BF16)
    return stored, dense, expected


@pytest.fixture
def case():
    """A small checkpoint covering every format, and the dense values it must load to (fresh copies)."""
    stored, dense, expected = _build_case()
    return ({k: v.clone() for k, v in stored.items()}, {k: v.clone() for k, v in dense.items()}, dict(expected))


def _save(path, tensors, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name))
    return path


def test_load_every_format(tmp_path, case):
    stored, dense, expected = case
    out = load_weights(_save(tmp_path, stored), expected, progress=False)
    assert set(out) == set(dense)
    for name, want in dense.items():
        assert out[name].dtype == expected[name][1], name
        assert torch.equal(out[name].float() if want.is_floating_point() else out[name], want), name


def test_dtype_override_keeps_fp32_tensors(tmp_path, case):
    stored, dense, expected = case
    out = load_weights(_save(tmp_path, stored), expected, dtype=BF16, progress=False)
    assert out["layers.0.hc_attn_fn"].dtype == F32 and out["layers.0.attn.attn_sink"].dtype == F32
    assert out["layers.0.attn.wq_a.weight"].dtype == BF16 and out["norm.weight"].dtype == BF16
    assert out["layers.0.ffn.gate.tid2eid"].dtype == I64
    assert torch.equal(out["layers.0.attn.wq_a.weight"], dense["layers.0.attn.wq_a.weight"].to(BF16))


def test_sharded_index(tmp_path, case):
    stored, dense, expected = case
    names = sorted(stored)
    a, b = names[: len(names) // 2], names[len(names) // 2:]
    _save(tmp_path, {k: stored[k] for k in a}, "model-00001-of-00002.safetensors")
    _save(tmp_path, {k: stored[k] for k in b}, "model-00002-of-00002.safetensors")
    _save(tmp_path, {"stale.weight": torch.ones(1)}, "model.safetensors")  # the index wins over this file
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    out = load_weights(tmp_path, expected, progress=False)
    assert torch.equal(out["layers.0.attn.wkv.weight"], dense["layers.0.attn.wkv.weight"])


def test_shards_without_index(tmp_path, case):
    stored, dense, expected = case
    names = sorted(stored)
    _save(tmp_path, {k: stored[k] for k in names[:5]}, "a.safetensors")
    _save(tmp_path, {k: stored[k] for k in names[5:]}, "b.safetensors")
    out = load_weights(tmp_path, expected, progress=False)
    assert torch.equal(out["layers.0.ffn.experts.0.w1.weight"], dense["layers.0.ffn.experts.0.w1.weight"])


def test_engram_table_padded_to_256_rows_is_cut(tmp_path, case):
    stored, dense, expected = case
    q = torch.zeros(256, 64).to(torch.float8_e4m3fn)
    q[:7] = stored["layers.0.engram.embed.weight"]
    s = torch.full((256, 2), 127, dtype=torch.uint8)
    s[:7] = stored["layers.0.engram.embed.scale"].view(torch.uint8)
    stored["layers.0.engram.embed.weight"], stored["layers.0.engram.embed.scale"] = q, s.view(torch.float8_e8m0fnu)
    out = load_weights(_save(tmp_path, stored), expected, progress=False)
    assert torch.equal(out["layers.0.engram.embed.weight"], dense["layers.0.engram.embed.weight"])


TF_TABLE = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
    "layers.3.input_layernorm.weight": "layers.3.attn_norm.weight",
    "layers.3.post_attention_layernorm.weight": "layers.3.ffn_norm.weight",
    "layers.3.attn_hc.fn": "layers.3.hc_attn_fn", "layers.3.attn_hc.base": "layers.3.hc_attn_base",
    "layers.3.attn_hc.scale": "layers.3.hc_attn_scale", "layers.3.ffn_hc.fn": "layers.3.hc_ffn_fn",
    "layers.3.ffn_hc.base": "layers.3.hc_ffn_base", "layers.3.ffn_hc.scale": "layers.3.hc_ffn_scale",
    "layers.3.self_attn.q_a_proj.weight": "layers.3.attn.wq_a.weight",
    "layers.3.self_attn.q_a_norm.weight": "layers.3.attn.q_norm.weight",
    "layers.3.self_attn.q_b_proj.weight": "layers.3.attn.wq_b.weight",
    "layers.3.self_attn.kv_proj.weight": "layers.3.attn.wkv.weight",
    "layers.3.self_attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
    "layers.3.self_attn.o_a_proj.weight": "layers.3.attn.wo_a.weight",
    "layers.3.self_attn.o_b_proj.weight": "layers.3.attn.wo_b.weight",
    "layers.3.self_attn.sinks": "layers.3.attn.attn_sink",
    "layers.3.self_attn.compressor.kv_proj.weight": "layers.3.attn.compressor.wkv.weight",
    "layers.3.self_attn.compressor.gate_proj.weight": "layers.3.attn.compressor.wgate.weight",
    "layers.3.self_attn.compressor.position_bias": "layers.3.attn.compressor.ape",
    "layers.3.self_attn.compressor.kv_norm.weight": "layers.3.attn.compressor.norm.weight",
    "layers.3.self_attn.compressor.indexer.kv_proj.weight": "layers.3.attn.indexer.compressor.wkv.weight",
    "layers.3.self_attn.compressor.indexer.gate_proj.weight": "layers.3.attn.indexer.compressor.wgate.weight",
    "layers.3.self_attn.compressor.indexer.position_bias": "layers.3.attn.indexer.compressor.ape",
    "layers.3.self_attn.compressor.indexer.kv_norm.weight": "layers.3.attn.indexer.compressor.norm.weight",
    "layers.3.self_attn.compressor.indexer.q_b_proj.weight": "layers.3.attn.indexer.wq_b.weight",
    "layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight": "layers.3.attn.indexer.weights_proj.weight",
    "layers.3.mlp.gate.weight": "layers.3.ffn.gate.weight",
    "layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
    "layers.3.mlp.gate.tid2eid": "layers.3.ffn.gate.tid2eid",
    "layers.3.mlp.shared_experts.gate_proj.weight": "layers.3.ffn.shared_experts.w1.weight",
    "layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
    "layers.3.mlp.shared_experts.down_proj.weight": "layers.3.ffn.shared_experts.w2.weight",
    "layers.3.self_attn.q_a_proj.weight_scale_inv": "layers.3.attn.wq_a.weight_scale_inv",
}


def test_tf_to_canonical_table():
    for tf, canon in TF_TABLE.items():
        assert tf_to_canonical(tf) == canon, tf
    assert tf_to_canonical("layers.3.attn.wq_a.weight") is None  # canonical names are not TF names
    assert tf_to_canonical("layers.3.self_attn.bogus.weight") is None


def test_transformers_names_and_stacked_experts(tmp_path):
    g = torch.Generator().manual_seed(1)
    E, I, D = 3, 4, 6
    gate_up, down = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    stored = {
        "model.embed_tokens.weight": torch.randn(5, D, generator=g),
        "lm_head.weight": torch.randn(5, D, generator=g),
        "model.layers.0.self_attn.sinks": torch.randn(2, generator=g),
        "model.layers.0.attn_hc.scale": torch.randn(3, generator=g),
        "model.layers.0.mlp.experts.gate_up_proj": gate_up,
        "model.layers.0.mlp.experts.down_proj": down,
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(E, generator=g),
        "model.layers.0.self_attn.compressor.indexer.scorer.weights_proj.weight": torch.randn(2, D, generator=g),
    }
    expected = {"embed.weight": ((5, D), F32), "head.weight": ((5, D), F32), "layers.0.attn.attn_sink": ((2,), F32),
                "layers.0.hc_attn_scale": ((3,), F32), "layers.0.ffn.gate.bias": ((E,), F32),
                "layers.0.attn.indexer.weights_proj.weight": ((2, D), F32)}
    for e in range(E):
        expected.update({f"layers.0.ffn.experts.{e}.w1.weight": ((I, D), F32),
                         f"layers.0.ffn.experts.{e}.w3.weight": ((I, D), F32),
                         f"layers.0.ffn.experts.{e}.w2.weight": ((D, I), F32)})
    out = load_weights(_save(tmp_path, stored), expected, progress=False)
    assert torch.equal(out["head.weight"], stored["lm_head.weight"])
    assert torch.equal(out["layers.0.hc_attn_scale"], stored["model.layers.0.attn_hc.scale"])
    for e in range(E):
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w1.weight"], gate_up[e, :I])
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w3.weight"], gate_up[e, I:])
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w2.weight"], down[e])


def test_stacked_fp8_experts_with_scale_inv(tmp_path):
    E, I, D = 2, 32, 64
    q = torch.full((E, 2 * I, D), 2.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[[1.0, 2.0], [4.0, 8.0]], [[0.5, 0.5], [0.25, 0.25]]])  # 32x32 blocks
    stored = {"layers.1.mlp.experts.gate_up_proj": q, "layers.1.mlp.experts.gate_up_proj_scale_inv": s,
              "layers.1.mlp.experts.down_proj": torch.ones(E, D, I)}
    expected = {}
    for e in range(E):
        expected.update({f"layers.1.ffn.experts.{e}.w1.weight": ((I, D), F32),
                         f"layers.1.ffn.experts.{e}.w3.weight": ((I, D), F32),
                         f"layers.1.ffn.experts.{e}.w2.weight": ((D, I), F32)})
    out = load_weights(_save(tmp_path, stored), expected, progress=False)
    w1, w3 = out["layers.1.ffn.experts.0.w1.weight"], out["layers.1.ffn.experts.0.w3.weight"]
    assert w1[0, 0] == 2.0 and w1[0, 40] == 4.0 and w3[0, 0] == 8.0 and w3[0, 63] == 16.0
    assert out["layers.1.ffn.experts.1.w3.weight"][5, 5] == 0.5


def test_mtp_tensors_the_model_does_not_build_are_ignored(tmp_path):
    stored = {"norm.weight": torch.ones(4), "mtp.0.attn.wq_a.weight": torch.ones(2, 2),
              "mtp.0.embed.weight": torch.ones(2, 2)}
    out = load_weights(_save(tmp_path, stored), {"norm.weight": ((4,), F32)}, progress=False)
    assert list(out) == ["norm.weight"]
    # with draft layers: DSpark head copies at other indices are ignored, unknown mtp tensors are not
    stored = {"mtp.1.norm.weight": torch.ones(4), "mtp.0.main_proj.weight": torch.ones(4, 8),
              "mtp.1.main_proj.weight": torch.ones(4, 8)}
    expected = {"mtp.1.norm.weight": ((4,), F32), "mtp.0.main_proj.weight": ((4, 8), F32)}
    assert set(load_weights(_save(tmp_path / "b", stored), expected, progress=False)) == set(expected)
    stored["mtp.0.attn.bogus.weight"] = torch.ones(1)
    with pytest.raises(ValueError, match="unexpected.*mtp.0.attn.bogus.weight"):
        load_weights(_save(tmp_path / "c", stored), expected, progress=False)


# --- error paths --------------------------------------------------------------------------------------


def _err(tmp_path, stored, expected, match, **kw):
    _save(tmp_path, stored)
    with pytest.raises(ValueError, match=match):
        load_weights(tmp_path, expected, progress=False, **kw)


def test_missing_tensor_names_it(tmp_path, case):
    stored, _, expected = case
    del stored["layers.0.attn.attn_sink"]
    _err(tmp_path, stored, expected, r"missing 1 tensor.*'layers.0.attn.attn_sink' \(shape \(2,\) dtype float32\)")


def test_unknown_tensor_names_it(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.attn.bogus.weight"] = torch.ones(3, 2)
    _err(tmp_path, stored, expected, r"unexpected tensor.*'layers.0.attn.bogus.weight' \(shape \(3, 2\) dtype float32")


def test_shape_mismatch(tmp_path, case):
    stored, _, expected = case
    stored["norm.weight"] = torch.ones(5)
    _err(tmp_path, stored, expected, r"'norm.weight': expected shape \(4,\) dtype float32, found shape \(5,\)")


def test_fp8_dense_shape_mismatch(tmp_path, case):
    stored, _, expected = case
    expected["layers.0.attn.wq_a.weight"] = ((40, 64), F32)
    _err(tmp_path, stored, expected, r"'layers.0.attn.wq_a.weight': expected shape \(40, 64\).*found shape \(40, 70\)")


def test_int_expected_float_found(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.ffn.gate.tid2eid"] = torch.zeros(3, 2)
    _err(tmp_path, stored, expected, r"'layers.0.ffn.gate.tid2eid': expected dtype int64, found .*float32")


def test_float_expected_int_found(tmp_path, case):
    stored, _, expected = case
    stored["norm.weight"] = torch.zeros(4, dtype=torch.int32)
    _err(tmp_path, stored, expected, r"'norm.weight': expected dtype float32, found .*int32")


def test_fp8_without_scale(tmp_path, case):
    stored, _, expected = case
    del stored["layers.0.attn.wq_a.scale"]
    _err(tmp_path, stored, expected, r"'layers.0.attn.wq_a.weight': float8_e4m3fn weight without a scale")


def test_fp4_without_scale(tmp_path, case):
    stored, _, expected = case
    del stored["layers.0.ffn.experts.0.w1.scale"]
    _err(tmp_path, stored, expected, r"'layers.0.ffn.experts.0.w1.weight': packed fp4")


def test_scale_without_weight(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.attn.wo_a.weight_scale_inv"] = torch.ones(1, 1)
    _err(tmp_path, stored, expected, r"scale 'layers.0.attn.wo_a.weight_scale_inv'.*has no weight")


def test_scale_on_dense_weight(tmp_path, case):
    stored, _, expected = case
    stored["norm.weight_scale_inv"] = torch.ones(1)
    _err(tmp_path, stored, expected, r"'norm.weight': has a scale")


def test_bad_fp8_scale_grid(tmp_path, case):
    stored, _, expected = case
    # ceil(70 / B) == 7 needs B in [10, 11]: no power-of-two block fits
    stored["layers.0.attn.wq_a.scale"] = torch.full((2, 7), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _err(tmp_path, stored, expected, r"'layers.0.attn.wq_a.weight': scale .*\(2, 7\) does not fit")


def test_bad_fp4_scale(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.ffn.experts.0.w1.scale"] = torch.full((4, 3), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _err(tmp_path, stored, expected, r"'layers.0.ffn.experts.0.w1.weight': fp4 scale")


def test_bad_scale_dtype(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.attn.wq_a.scale"] = torch.ones(2, 3, dtype=torch.int32)
    _err(tmp_path, stored, expected, r"scale 'layers.0.attn.wq_a.scale' has dtype int32")


def test_fp32_tensor_stored_in_bf16(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.hc_attn_fn"] = stored["layers.0.hc_attn_fn"].to(BF16)
    _err(tmp_path, stored, expected, r"'layers.0.hc_attn_fn': must be stored as float32")


def test_ue8m0_weight(tmp_path, case):
    stored, _, expected = case
    stored["norm.weight"] = torch.ones(4).to(torch.float8_e8m0fnu)
    _err(tmp_path, stored, expected, r"'norm.weight': ue8m0 is a scale format")


def test_engram_table_too_many_rows(tmp_path, case):
    stored, _, expected = case
    stored["layers.0.engram.embed.weight"] = torch.zeros(300, 64).to(torch.float8_e4m3fn)
    stored["layers.0.engram.embed.scale"] = torch.ones(300, 2).to(torch.float8_e8m0fnu)
    _err(tmp_path, stored, expected, r"'layers.0.engram.embed.weight': expected shape \(10, 64\) \(rows may be padded")


def test_duplicate_after_prefix_strip(tmp_path, case):
    stored, _, expected = case
    stored["model.norm.weight"] = stored["norm.weight"].clone()
    _err(tmp_path, stored, expected, r"'norm.weight' is stored twice")


def test_index_lists_missing_shard(tmp_path, case):
    stored, _, expected = case
    _save(tmp_path, stored, "model-1.safetensors")
    wm = {k: "model-1.safetensors" for k in stored} | {"x.weight": "model-2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ValueError, match="shard 'model-2.safetensors', which does not exist"):
        load_weights(tmp_path, expected, progress=False)


def test_index_lists_tensor_not_in_shard(tmp_path, case):
    stored, _, expected = case
    _save(tmp_path, stored, "model-1.safetensors")
    wm = {k: "model-1.safetensors" for k in stored} | {"x.weight": "model-1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ValueError, match="'x.weight' in 'model-1.safetensors', but that file does not hold it"):
        load_weights(tmp_path, expected, progress=False)


def test_stacked_expert_count_mismatch(tmp_path):
    stored = {"layers.0.mlp.experts.gate_up_proj": torch.ones(3, 8, 6),
              "layers.0.mlp.experts.down_proj": torch.ones(3, 6, 4)}
    expected = {}
    for e in range(2):
        expected.update({f"layers.0.ffn.experts.{e}.w1.weight": ((4, 6), F32),
                         f"layers.0.ffn.experts.{e}.w3.weight": ((4, 6), F32),
                         f"layers.0.ffn.experts.{e}.w2.weight": ((6, 4), F32)})
    _err(tmp_path, stored, expected, r"stacked 3 experts but the model expects 2")


def test_stacked_expert_shape_mismatch(tmp_path):
    stored = {"layers.0.mlp.experts.gate_up_proj": torch.ones(1, 6, 6),
              "layers.0.mlp.experts.down_proj": torch.ones(1, 6, 4)}
    expected = {"layers.0.ffn.experts.0.w1.weight": ((4, 6), F32), "layers.0.ffn.experts.0.w3.weight": ((4, 6), F32),
                "layers.0.ffn.experts.0.w2.weight": ((6, 4), F32)}
    _err(tmp_path, stored, expected, r"'layers.0.ffn.experts.0.w1.weight': expected shape \(4, 6\).*stacked")


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_weights(tmp_path / "nope", {}, progress=False)
    with pytest.raises(ValueError, match="no safetensors files"):
        load_weights(tmp_path, {}, progress=False)


# --- load_checkpoint ----------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.embed = nn.Module()  # plain parameters: nn.Embedding's init on meta pulls in torch._dynamo (slow)
        self.embed.weight = nn.Parameter(torch.zeros(8, 4, device=device))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(4, device=device))
        self.register_buffer("tid2eid", torch.zeros(3, 2, dtype=torch.long, device=device))
        self.loaded = False

    def post_load(self):
        self.loaded = True


def test_load_checkpoint_fills_module(tmp_path):
    tensors = {"embed.weight": torch.randn(8, 4).to(BF16), "norm.weight": torch.randn(4),
               "tid2eid": torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)}
    _save(tmp_path, tensors)
    model = _Tiny()
    stats = load_checkpoint(model, tmp_path, progress=False)
    assert model.loaded and stats["tensors"] == 3 and stats["elements"] == 32 + 4 + 6
    assert model.embed.weight.dtype == F32 and torch.equal(model.embed.weight, tensors["embed.weight"].float())
    assert torch.equal(model.tid2eid, tensors["tid2eid"].long())
    meta = _Tiny(device="meta")
    load_checkpoint(meta, tmp_path, dtype=BF16, progress=False)
    assert not meta.embed.weight.is_meta and meta.embed.weight.dtype == BF16
    assert isinstance(meta.norm.weight, nn.Parameter) and torch.equal(meta.norm.weight, tensors["norm.weight"].to(BF16))
