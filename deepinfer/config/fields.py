"""Readers of config.json values: each checks its key's type and range and names the key in the
error (docs/model.md §1.3), and the fields V4 and V4.1 read the same way."""
from __future__ import annotations

from typing import Any

import torch

V4 = "deepseek_v4"
V41 = "deepseek_v41"

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def fail(key: str, msg: str) -> None:
    raise ValueError(f"config {key}: {msg}")


def read_int(d: dict, key: str, low: int = 1, default: Any = ..., prefix: str = "") -> int:
    if key not in d or d[key] is None:
        if default is ...:
            fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        fail(prefix + key, f"must be an integer >= {low}, got {v!r}")
    return v


def read_float(d: dict, key: str, default: Any = ..., positive: bool = True, prefix: str = "") -> float:
    if key not in d or d[key] is None:
        if default is ...:
            fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
        fail(prefix + key, f"must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def read_int_list(d: dict, key: str, prefix: str, low: int = 0, high: int | None = None, default: Any = ...) -> list[int]:
    if key not in d or d[key] is None:
        if default is ...:
            fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if not isinstance(v, (list, tuple)):
        fail(prefix + key, f"must be a list of integers, got {v!r}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < low or (high is not None and x > high):
            rng = f"[{low}, {high}]" if high is not None else f">= {low}"
            fail(prefix + key, f"entries must be integers in {rng}, got {x!r}")
    return list(v)


def source_map(ids: list[int], num_layers: int) -> list[int]:
    """Layer -> its source: max{s in ids : s <= layer}; layers below min(ids) are their own (§1.2)."""
    ids = sorted(set(ids))
    out = []
    for layer in range(num_layers):
        below = [s for s in ids if s <= layer]
        out.append(max(below) if below else layer)
    return out


def read_yarn(block: dict | None, key: str) -> dict | None:
    """Normalize a YaRN block (legacy rope_scaling or rope_parameters) to the four fields we use."""
    if not block:
        return None
    if not isinstance(block, dict):
        fail(key, f"must be a dict, got {block!r}")
    kind = block.get("rope_type", block.get("type", "yarn"))
    if kind == "default":
        return None
    if kind != "yarn":
        fail(key + ".rope_type", f"only 'yarn' (or 'default') is supported, got {kind!r}")
    out = {}
    fields = (("factor", ...), ("original_max_position_embeddings", ...), ("beta_fast", 32.0), ("beta_slow", 1.0))
    for k, default in fields:
        if k not in block or block[k] is None:
            if default is ...:
                fail(f"{key}.{k}", "missing (required for YaRN)")
            out[k] = default
            continue
        v = block[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            fail(f"{key}.{k}", f"must be a positive number, got {v!r}")
        out[k] = v
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    out["factor"] = float(out["factor"])
    out["beta_fast"], out["beta_slow"] = float(out["beta_fast"]), float(out["beta_slow"])
    return out


def read_dtype(raw: dict, text: dict) -> torch.dtype:
    name = raw.get("dtype", raw.get("torch_dtype", text.get("dtype", text.get("torch_dtype", "bfloat16"))))
    if name is None:
        name = "bfloat16"
    if name not in _DTYPES:
        fail("dtype", f"must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def read_eos(value: Any, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            fail(key, f"must be a non-negative integer or a list of them, got {value!r}")
    return list(values)


def read_token(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        fail(key, f"must be a non-negative integer or null, got {v!r}")
    return v


def read_quant(q: Any) -> dict | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        fail("quantization_config", f"must be an object, got {q!r}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        fail("quantization_config.quant_method", f"only 'fp8' is supported, got {method!r}")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        fail("quantization_config.weight_block_size", f"must be two positive integers, got {block!r}")
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt not in ("ue8m0", "float"):
        fail("quantization_config.scale_fmt", f"must be 'ue8m0' or 'float', got {scale_fmt!r}")
    expert_dtype = q.get("expert_dtype", "fp8")
    if expert_dtype not in ("fp4", "fp8"):
        fail("quantization_config.expert_dtype", f"must be 'fp4' or 'fp8', got {expert_dtype!r}")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        fail("quantization_config.activation_scheme", f"only 'dynamic' is supported, got {act!r}")
    return {"weight_block_size": [int(block[0]), int(block[1])], "scale_fmt": scale_fmt, "expert_dtype": expert_dtype}


def common_fields(t: dict, prefix: str) -> dict:
    """Keys with the same meaning in V4 and V4.1 (`t` is the dict holding the model keys)."""
    hidden_act = t.get("hidden_act", "silu")
    if hidden_act != "silu":
        fail(prefix + "hidden_act", f"must be 'silu', got {hidden_act!r}")
    scoring = t.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        fail(prefix + "scoring_func", f"must be 'sqrtsoftplus', got {scoring!r}")
    kv_heads = t.get("num_key_value_heads", 1)
    if kv_heads != 1:
        fail(prefix + "num_key_value_heads", f"must be 1, got {kv_heads!r}")
    if t.get("attention_bias", False):
        fail(prefix + "attention_bias", "must be false")
    if t.get("attention_dropout", 0.0) not in (0, 0.0):
        fail(prefix + "attention_dropout", f"must be 0, got {t.get('attention_dropout')!r}")
    norm_topk = t.get("norm_topk_prob", True)
    if norm_topk is not True:
        fail(prefix + "norm_topk_prob", f"must be true, got {norm_topk!r}")
    topk_method = t.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        fail(prefix + "topk_method", f"must be 'noaux_tc', got {topk_method!r}")
    tie = t.get("tie_word_embeddings", False)
    if tie:
        fail(prefix + "tie_word_embeddings", "must be false (the LM head is untied)")
    return dict(
        vocab_size=read_int(t, "vocab_size", prefix=prefix),
        hidden_size=read_int(t, "hidden_size", prefix=prefix),
        num_layers=read_int(t, "num_hidden_layers", prefix=prefix),
        num_heads=read_int(t, "num_attention_heads", prefix=prefix),
        head_dim=read_int(t, "head_dim", prefix=prefix),
        q_lora_rank=read_int(t, "q_lora_rank", prefix=prefix),
        o_groups=read_int(t, "o_groups", prefix=prefix),
        o_lora_rank=read_int(t, "o_lora_rank", prefix=prefix),
        n_routed_experts=read_int(t, "n_routed_experts", prefix=prefix),
        n_experts_per_tok=read_int(t, "num_experts_per_tok", prefix=prefix),
        n_shared_experts=read_int(t, "n_shared_experts", low=0, default=1, prefix=prefix),
        moe_inter_size=read_int(t, "moe_intermediate_size", prefix=prefix),
        routed_scaling_factor=read_float(t, "routed_scaling_factor", default=1.0, prefix=prefix),
        swiglu_limit=read_float(t, "swiglu_limit", default=10.0, prefix=prefix),
        norm_topk_prob=True,
        rms_norm_eps=read_float(t, "rms_norm_eps", default=1e-6, prefix=prefix),
        hc_mult=read_int(t, "hc_mult", default=4, prefix=prefix),
        hc_sinkhorn_iters=read_int(t, "hc_sinkhorn_iters", default=20, prefix=prefix),
        hc_eps=read_float(t, "hc_eps", default=1e-6, prefix=prefix),
        sliding_window=read_int(t, "sliding_window", prefix=prefix),
        index_n_heads=read_int(t, "index_n_heads", prefix=prefix),
        index_head_dim=read_int(t, "index_head_dim", prefix=prefix),
        index_topk=read_int(t, "index_topk", prefix=prefix),
        max_position_embeddings=read_int(t, "max_position_embeddings", prefix=prefix),
        num_nextn_predict_layers=read_int(t, "num_nextn_predict_layers", low=0, default=0, prefix=prefix),
        tie_word_embeddings=False,
    )


def rope_fields(t: dict, prefix: str, head_dim: int) -> dict:
    """rope_dim, thetas and the YaRN block from either spelling."""
    rp = t.get("rope_parameters")
    nested = isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    main = rp["main"] if nested else {}
    comp = rp["compress"] if nested else (rp if isinstance(rp, dict) else {})

    legacy_r = t.get("qk_rope_head_dim")
    factor = t.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    if legacy_r is not None:
        r = read_int(t, "qk_rope_head_dim", prefix=prefix)
        if factor is not None and int(head_dim * factor) != r:
            fail(prefix + "partial_rotary_factor", f"{factor} * head_dim {head_dim} != qk_rope_head_dim {r}")
    elif factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            fail(prefix + "partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
        r = int(head_dim * factor)
    else:
        fail(prefix + "qk_rope_head_dim", "missing (or partial_rotary_factor)")

    # Only the nested TF form carries per-kind thetas; a flat YaRN block's rope_theta is ignored (as TF does).
    theta_src = {"rope_theta": main.get("rope_theta"),
                 "compress_rope_theta": comp.get("rope_theta") if nested else None}
    theta = {k: t.get(k, theta_src[k]) for k in theta_src}
    rope_theta = read_float(theta, "rope_theta", default=10000.0, prefix=prefix)
    compress_theta = read_float(theta, "compress_rope_theta", default=160000.0, prefix=prefix)

    if t.get("rope_scaling"):
        yarn = read_yarn(t["rope_scaling"], prefix + "rope_scaling")
    else:
        yarn = read_yarn({k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                                    "attention_factor")} or None,
                     prefix + "rope_parameters")
    return dict(rope_dim=r, rope_theta=rope_theta, compress_rope_theta=compress_theta, rope_scaling=yarn)
