"""V4.1 config.json (docs/model.md §1.2): the model keys under `text_config`, KV / index sharing,
candidate blocks, Engram and DSpark; and the cross-field rules of §1.3 that only V4.1 has."""
from __future__ import annotations

from deepinfer.config.fields import (V41, common_fields, fail, read_dtype, read_eos, read_int, read_int_list,
                                     read_quant, read_token, rope_fields, source_map)

_V41_KIND = {0: "swa", 1: "c1", 2: "c2"}


def parse_v41(raw: dict) -> dict:
    """The ModelConfig fields of a V4.1 config.json."""
    arch = raw.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
        fail("architectures", f"must hold exactly one name, got {arch!r}")
    t = raw.get("text_config")
    if not isinstance(t, dict):
        fail("text_config", "missing (required for deepseek_v41)")
    p = "text_config."
    kw = common_fields(t, p)
    L = kw["num_layers"]
    nextn = kw["num_nextn_predict_layers"]
    kw.update(rope_fields(t, p, kw["head_dim"]))

    ratios_all = read_int_list(t, "compress_ratios", p, low=0, high=2)
    if len(ratios_all) != L + nextn:
        fail(p + "compress_ratios", f"length must be num_hidden_layers + num_nextn_predict_layers = {L + nextn}, "
                                     f"got {len(ratios_all)}")
    ratios = ratios_all[:L]  # draft layers are SWA-only whatever their entry says (DI _dflash_spec)

    kv_ids = read_int_list(t, "kv_source_layer_ids", p, 0, L - 1, default=[])
    index_ids = read_int_list(t, "index_source_layer_ids", p, 0, L - 1, default=[])
    index_k_ids = read_int_list(t, "index_k_source_layer_ids", p, 0, L - 1, default=list(kv_ids))

    cand = t.get("candidate_source_layer_id")
    cand_blocks = cand_size = None
    if cand is not None:
        cand = read_int(t, "candidate_source_layer_id", low=0, prefix=p)
        if cand >= L:
            fail(p + "candidate_source_layer_id", f"must be in [0, {L - 1}], got {cand}")
        cand_blocks = read_int(t, "candidate_topk_blocks", prefix=p)
        cand_size = read_int(t, "candidate_block_size", prefix=p)

    engram_ids = read_int_list(t, "engram_layer_ids", p, 0, L - 1, default=[])
    engram = {}
    if engram_ids:
        engram = dict(
            engram_max_ngram_size=read_int(t, "engram_max_ngram_size", low=2, prefix=p),
            engram_vocab_size=read_int(t, "engram_vocab_size", low=2, prefix=p),
            engram_n_heads=read_int(t, "engram_n_heads", prefix=p),
            engram_head_dim=read_int(t, "engram_head_dim", prefix=p),
            engram_compressed_vocab=bool(t.get("engram_compressed_vocab_size")),
            engram_pad_token_id=read_int(t, "engram_pad_token_id", low=0, default=raw.get("pad_token_id"), prefix=p),
        )

    dspark = {}
    if nextn:
        if t.get("dspark_target_attn_input", True) is not True:
            fail(p + "dspark_target_attn_input", "must be true (DI asserts it)")
        dspark = dict(
            dspark_block_size=read_int(t, "dspark_block_size", prefix=p),
            dspark_target_layer_ids=read_int_list(t, "dspark_target_layer_ids", p, 0, L - 1),
            dspark_markov_rank=read_int(t, "dspark_markov_rank", prefix=p),
            dspark_noise_token_id=read_int(t, "dspark_noise_token_id", low=0, prefix=p),
            dspark_n_routed_experts=read_int(t, "dspark_n_routed_experts", prefix=p),
            dspark_num_experts_per_tok=read_int(t, "dspark_num_experts_per_tok", prefix=p),
        )
        if not dspark["dspark_target_layer_ids"]:
            fail(p + "dspark_target_layer_ids", "must be non-empty when num_nextn_predict_layers > 0")

    ones = [i for i, m in enumerate(ratios) if m == 1]
    return dict(
        model_type=V41,
        **kw,
        bos_token_id=read_token(raw, "bos_token_id"),
        eos_token_ids=read_eos(raw.get("eos_token_id"), "eos_token_id"),
        pad_token_id=read_token(raw, "pad_token_id"),
        torch_dtype=read_dtype(raw, t),
        compress_ratios=ratios,
        layer_kinds=[_V41_KIND[m] for m in ratios],
        hash_moe=[False] * L,
        hc_shifted=bool(t.get("hc_shifted", True)),
        kv_source_layer_ids=sorted(set(kv_ids)),
        index_source_layer_ids=sorted(set(index_ids)),
        index_k_source_layer_ids=sorted(set(index_k_ids)),
        kv_source_map=source_map(kv_ids, L),
        index_source_map=source_map(index_ids, L),
        index_k_source_map=source_map(index_k_ids, L),
        candidate_source_layer_id=cand,
        candidate_topk_blocks=cand_blocks,
        candidate_block_size=cand_size,
        use_fp4_sparse_kv=bool(t.get("use_fp4_sparse_kv", True)),
        n_prefill_layer=ones[0] if ones else L,  # no ratio-1 layer: no YOCO (docs/model.md §1.2)
        engram_layer_ids=sorted(set(engram_ids)),
        **engram,
        **dspark,
        quant=read_quant(raw.get("quantization_config")),
    )


def validate_v41(c) -> None:
    """The V4.1 rules across fields of a built ModelConfig `c`."""
    p = "text_config."
    L, ratios = c.num_layers, c.compress_ratios
    lists = {"kv_source_layer_ids": c.kv_source_layer_ids, "index_source_layer_ids": c.index_source_layer_ids,
             "index_k_source_layer_ids": c.index_k_source_layer_ids}
    maps = {"kv_source_layer_ids": c.kv_source_map, "index_source_layer_ids": c.index_source_map,
            "index_k_source_layer_ids": c.index_k_source_map}
    for key, ids in lists.items():
        for s in ids:
            if ratios[s] == 0:
                fail(p + key, f"source layer {s} has compress ratio 0; sources need ratio 1 or 2")
    all_ids = [s for ids in lists.values() for s in ids]
    if all_ids:
        first = min(all_ids)
        for layer in range(first, L):
            if ratios[layer] == 0:
                fail(f"{p}compress_ratios[{layer}]", f"ratio 0 after the first source layer {first}; "
                                                      "allowed values there: 1 or 2")
    for key, m in maps.items():
        for layer in range(L):
            if ratios[layer] and ratios[m[layer]] != ratios[layer]:
                fail(p + key, f"layer {layer} (ratio {ratios[layer]}) maps to source {m[layer]} "
                               f"with ratio {ratios[m[layer]]}; a layer and its source need the same ratio")

    def effective(m: list[int]) -> set[int]:
        return {layer for layer in range(L) if ratios[layer] and m[layer] == layer}

    kv, idx, idx_k = effective(c.kv_source_map), effective(c.index_source_map), effective(c.index_k_source_map)
    if not kv <= idx_k:
        fail(p + "index_k_source_layer_ids", f"kv sources {sorted(kv)} must be index-K sources {sorted(idx_k)}")
    if not idx_k <= idx:
        fail(p + "index_source_layer_ids", f"index-K sources {sorted(idx_k)} must be index sources {sorted(idx)}")
    if idx_k != kv:
        # §8 item 8: index keys come from the layer's own pre-RoPE latent, so they need a kv source
        fail(p + "index_k_source_layer_ids", f"index-K sources {sorted(idx_k)} must equal kv sources {sorted(kv)}")
    if c.n_prefill_layer < L and c.n_prefill_layer not in kv:
        fail(p + "kv_source_layer_ids", f"the first YOCO layer {c.n_prefill_layer} (first ratio-1 layer) "
                                         f"must be a kv source, got {sorted(kv)}")
    if c.rope_dim != 64:
        fail(p + "qk_rope_head_dim", f"must be 64 (the V4.1 indexer RoPE width), got {c.rope_dim}")

    cs = c.candidate_source_layer_id
    if cs is not None:
        if cs not in idx:
            fail(p + "candidate_source_layer_id", f"{cs} must be an index source with ratio > 0 {sorted(idx)}")
        if c.candidate_topk_blocks % 8:
            fail(p + "candidate_topk_blocks", f"must be a positive multiple of 8, got {c.candidate_topk_blocks}")
        if not 0 < c.candidate_block_size <= 16:
            fail(p + "candidate_block_size", f"must be in [1, 16], got {c.candidate_block_size}")
        for layer in range(cs + 1, L):
            if ratios[layer] != ratios[cs]:
                fail(f"{p}compress_ratios[{layer}]", f"must equal the candidate source's ratio {ratios[cs]} "
                                                      f"(layers after {cs}), got {ratios[layer]}")
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:
            fail(p + "candidate_topk_blocks", f"candidate_topk_blocks * candidate_block_size = "
                                               f"{c.candidate_topk_blocks * c.candidate_block_size} < index_topk "
                                               f"{c.index_topk}")
        if any(layer > cs for layer in idx):
            if c.index_n_heads > 32:
                fail(p + "index_n_heads", f"must be <= 32 with a candidate prefilter, got {c.index_n_heads}")
            if c.index_head_dim != 128:
                fail(p + "index_head_dim", f"must be 128 with a candidate prefilter, got {c.index_head_dim}")
            if c.candidate_block_size not in (8, 16):
                fail(p + "candidate_block_size", f"must be 8 or 16 with a filtered index layer, "
                                                  f"got {c.candidate_block_size}")
            if c.candidate_topk_blocks > 4096:
                fail(p + "candidate_topk_blocks", f"must be <= 4096, got {c.candidate_topk_blocks}")

    if c.engram_layer_ids and c.engram_head_dim % 32:
        fail(p + "engram_head_dim", f"must be a multiple of 32 (1x32 table scales), got {c.engram_head_dim}")
    if c.num_nextn_predict_layers:
        if c.dspark_num_experts_per_tok > c.dspark_n_routed_experts:
            fail(p + "dspark_num_experts_per_tok", f"must be <= dspark_n_routed_experts "
                                                    f"{c.dspark_n_routed_experts}, got {c.dspark_num_experts_per_tok}")
        if c.dspark_noise_token_id >= c.vocab_size:
            fail(p + "dspark_noise_token_id", f"must be < vocab_size {c.vocab_size}, got {c.dspark_noise_token_id}")

    if c.quant is not None:
        # §1.3 tiling: every FP8 weight dim and every expert in-dim is a multiple of 32
        dims = {"hidden_size": c.hidden_size, "q_lora_rank": c.q_lora_rank, "head_dim": c.head_dim,
                "moe_intermediate_size": c.moe_inter_size, "o_lora_rank": c.o_lora_rank * c.o_groups,
                "num_attention_heads * head_dim / o_groups": c.num_heads * c.head_dim // c.o_groups,
                "index_n_heads * index_head_dim": c.index_n_heads * c.index_head_dim}
        for key, v in dims.items():
            if v % 32:
                fail(p + key.split(" ")[0], f"{key} = {v} must be a multiple of 32 for FP8/FP4 weights")
