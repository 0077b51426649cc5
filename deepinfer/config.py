"""ModelConfig: the checkpoint's config.json, normalized and validated (docs/model.md §1).

Both spellings of V4 are accepted: the official DeepSeek keys (`compress_ratios` 0/4/128 possibly
listing L + nextn entries, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and the
transformers-normalised ones (`layer_types`, `mlp_layer_types`, `compress_rates`,
`partial_rotary_factor`, `rope_parameters`). V4.1 keeps its model keys in `text_config`.
Every rule of docs/model.md §1.3 is checked here, so the model can trust the attributes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

V4 = "deepseek_v4"
V41 = "deepseek_v41"

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_V4_KIND = {SWA: "swa", CSA: "csa", HCA: "hca"}
_V4_DEFAULT_RATES = {CSA: 4, HCA: 128}
_V4_DEFAULT_HASH_LAYERS = 3  # TF DeepseekV4Config.default_num_hash_layers
_V41_KIND = {0: "swa", 1: "c1", 2: "c2"}

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _fail(key: str, msg: str) -> None:
    raise ValueError(f"config {key}: {msg}")


def _int(d: dict, key: str, low: int = 1, default: Any = ..., prefix: str = "") -> int:
    if key not in d or d[key] is None:
        if default is ...:
            _fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        _fail(prefix + key, f"must be an integer >= {low}, got {v!r}")
    return v


def _float(d: dict, key: str, default: Any = ..., positive: bool = True, prefix: str = "") -> float:
    if key not in d or d[key] is None:
        if default is ...:
            _fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
        _fail(prefix + key, f"must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _int_list(d: dict, key: str, prefix: str, low: int = 0, high: int | None = None, default: Any = ...) -> list[int]:
    if key not in d or d[key] is None:
        if default is ...:
            _fail(prefix + key, "missing (required)")
        return default
    v = d[key]
    if not isinstance(v, (list, tuple)):
        _fail(prefix + key, f"must be a list of integers, got {v!r}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < low or (high is not None and x > high):
            rng = f"[{low}, {high}]" if high is not None else f">= {low}"
            _fail(prefix + key, f"entries must be integers in {rng}, got {x!r}")
    return list(v)


def source_map(ids: list[int], num_layers: int) -> list[int]:
    """Layer -> its source: max{s in ids : s <= layer}; layers below min(ids) are their own (§1.2)."""
    ids = sorted(set(ids))
    out = []
    for layer in range(num_layers):
        below = [s for s in ids if s <= layer]
        out.append(max(below) if below else layer)
    return out


def _yarn(block: dict | None, key: str) -> dict | None:
    """Normalize a YaRN block (legacy rope_scaling or rope_parameters) to the four fields we use."""
    if not block:
        return None
    if not isinstance(block, dict):
        _fail(key, f"must be a dict, got {block!r}")
    kind = block.get("rope_type", block.get("type", "yarn"))
    if kind == "default":
        return None
    if kind != "yarn":
        _fail(key + ".rope_type", f"only 'yarn' (or 'default') is supported, got {kind!r}")
    out = {}
    fields = (("factor", ...), ("original_max_position_embeddings", ...), ("beta_fast", 32.0), ("beta_slow", 1.0))
    for k, default in fields:
        if k not in block or block[k] is None:
            if default is ...:
                _fail(f"{key}.{k}", "missing (required for YaRN)")
            out[k] = default
            continue
        v = block[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            _fail(f"{key}.{k}", f"must be a positive number, got {v!r}")
        out[k] = v
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    out["factor"] = float(out["factor"])
    out["beta_fast"], out["beta_slow"] = float(out["beta_fast"]), float(out["beta_slow"])
    return out


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_experts_per_tok: int
    n_shared_experts: int
    moe_inter_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    norm_topk_prob: bool
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    torch_dtype: torch.dtype
    compress_ratios: list[int]
    layer_kinds: list[str]
    hash_moe: list[bool]
    hc_shifted: bool
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # V4.1 only (empty / None for V4)
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    index_k_source_layer_ids: list[int] = field(default_factory=list)
    kv_source_map: list[int] = field(default_factory=list)
    index_source_map: list[int] = field(default_factory=list)
    index_k_source_map: list[int] = field(default_factory=list)
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    use_fp4_sparse_kv: bool = False
    n_prefill_layer: int = 0
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab: bool = False
    engram_pad_token_id: int | None = None
    dspark_block_size: int | None = None
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    quant: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path/config.json` (or `path` itself if it is a file)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(path):
            raise ValueError(f"config.json not found: the model directory {path!r} does not exist")
        if not os.path.isfile(file):
            raise ValueError(f"config.json not found at {file}")
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"config: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == V4:
            cfg = _parse_v4(raw)
        elif model_type == V41:
            cfg = _parse_v41(raw)
        else:
            _fail("model_type", f"must be {V4!r} or {V41!r}, got {model_type!r}")
        cfg.raw = raw
        _validate_common(cfg)
        if cfg.is_v41:
            _validate_v41(cfg)
        return cfg


# ---------------------------------------------------------------------------------------------
# shared parsing
# ---------------------------------------------------------------------------------------------


def _dtype(raw: dict, text: dict) -> torch.dtype:
    name = raw.get("dtype", raw.get("torch_dtype", text.get("dtype", text.get("torch_dtype", "bfloat16"))))
    if name is None:
        name = "bfloat16"
    if name not in _DTYPES:
        _fail("dtype", f"must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _eos(value: Any, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(key, f"must be a non-negative integer or a list of them, got {value!r}")
    return list(values)


def _opt_token(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _fail(key, f"must be a non-negative integer or null, got {v!r}")
    return v


def _quant(q: Any) -> dict | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        _fail("quantization_config", f"must be an object, got {q!r}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        _fail("quantization_config.quant_method", f"only 'fp8' is supported, got {method!r}")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        _fail("quantization_config.weight_block_size", f"must be two positive integers, got {block!r}")
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt not in ("ue8m0", "float"):
        _fail("quantization_config.scale_fmt", f"must be 'ue8m0' or 'float', got {scale_fmt!r}")
    expert_dtype = q.get("expert_dtype", "fp8")
    if expert_dtype not in ("fp4", "fp8"):
        _fail("quantization_config.expert_dtype", f"must be 'fp4' or 'fp8', got {expert_dtype!r}")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        _fail("quantization_config.activation_scheme", f"only 'dynamic' is supported, got {act!r}")
    return {"weight_block_size": [int(block[0]), int(block[1])], "scale_fmt": scale_fmt, "expert_dtype": expert_dtype}


def _common_kwargs(t: dict, prefix: str) -> dict:
    """Keys with the same meaning in V4 and V4.1 (`t` is the dict holding the model keys)."""
    hidden_act = t.get("hidden_act", "silu")
    if hidden_act != "silu":
        _fail(prefix + "hidden_act", f"must be 'silu', got {hidden_act!r}")
    scoring = t.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        _fail(prefix + "scoring_func", f"must be 'sqrtsoftplus', got {scoring!r}")
    kv_heads = t.get("num_key_value_heads", 1)
    if kv_heads != 1:
        _fail(prefix + "num_key_value_heads", f"must be 1, got {kv_heads!r}")
    if t.get("attention_bias", False):
        _fail(prefix + "attention_bias", "must be false")
    if t.get("attention_dropout", 0.0) not in (0, 0.0):
        _fail(prefix + "attention_dropout", f"must be 0, got {t.get('attention_dropout')!r}")
    norm_topk = t.get("norm_topk_prob", True)
    if norm_topk is not True:
        _fail(prefix + "norm_topk_prob", f"must be true, got {norm_topk!r}")
    topk_method = t.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        _fail(prefix + "topk_method", f"must be 'noaux_tc', got {topk_method!r}")
    tie = t.get("tie_word_embeddings", False)
    if tie:
        _fail(prefix + "tie_word_embeddings", "must be false (the LM head is untied)")
    return dict(
        vocab_size=_int(t, "vocab_size", prefix=prefix),
        hidden_size=_int(t, "hidden_size", prefix=prefix),
        num_layers=_int(t, "num_hidden_layers", prefix=prefix),
        num_heads=_int(t, "num_attention_heads", prefix=prefix),
        head_dim=_int(t, "head_dim", prefix=prefix),
        q_lora_rank=_int(t, "q_lora_rank", prefix=prefix),
        o_groups=_int(t, "o_groups", prefix=prefix),
        o_lora_rank=_int(t, "o_lora_rank", prefix=prefix),
        n_routed_experts=_int(t, "n_routed_experts", prefix=prefix),
        n_experts_per_tok=_int(t, "num_experts_per_tok", prefix=prefix),
        n_shared_experts=_int(t, "n_shared_experts", low=0, default=1, prefix=prefix),
        moe_inter_size=_int(t, "moe_intermediate_size", prefix=prefix),
        routed_scaling_factor=_float(t, "routed_scaling_factor", default=1.0, prefix=prefix),
        swiglu_limit=_float(t, "swiglu_limit", default=10.0, prefix=prefix),
        norm_topk_prob=True,
        rms_norm_eps=_float(t, "rms_norm_eps", default=1e-6, prefix=prefix),
        hc_mult=_int(t, "hc_mult", default=4, prefix=prefix),
        hc_sinkhorn_iters=_int(t, "hc_sinkhorn_iters", default=20, prefix=prefix),
        hc_eps=_float(t, "hc_eps", default=1e-6, prefix=prefix),
        sliding_window=_int(t, "sliding_window", prefix=prefix),
        index_n_heads=_int(t, "index_n_heads", prefix=prefix),
        index_head_dim=_int(t, "index_head_dim", prefix=prefix),
        index_topk=_int(t, "index_topk", prefix=prefix),
        max_position_embeddings=_int(t, "max_position_embeddings", prefix=prefix),
        num_nextn_predict_layers=_int(t, "num_nextn_predict_layers", low=0, default=0, prefix=prefix),
        tie_word_embeddings=False,
    )


def _rope_fields(t: dict, prefix: str, head_dim: int) -> dict:
    """rope_dim, thetas and the YaRN block from either spelling."""
    rp = t.get("rope_parameters")
    nested = isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    main = rp["main"] if nested else {}
    comp = rp["compress"] if nested else (rp if isinstance(rp, dict) else {})

    legacy_r = t.get("qk_rope_head_dim")
    factor = t.get("partial_rotary_factor", main.get("partial_rotary_factor"))
    if legacy_r is not None:
        r = _int(t, "qk_rope_head_dim", prefix=prefix)
        if factor is not None and int(head_dim * factor) != r:
            _fail(prefix + "partial_rotary_factor", f"{factor} * head_dim {head_dim} != qk_rope_head_dim {r}")
    elif factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            _fail(prefix + "partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
        r = int(head_dim * factor)
    else:
        _fail(prefix + "qk_rope_head_dim", "missing (or partial_rotary_factor)")

    # Only the nested TF form carries per-kind thetas; a flat YaRN block's rope_theta is ignored (as TF does).
    theta_src = {"rope_theta": main.get("rope_theta"),
                 "compress_rope_theta": comp.get("rope_theta") if nested else None}
    theta = {k: t.get(k, theta_src[k]) for k in theta_src}
    rope_theta = _float(theta, "rope_theta", default=10000.0, prefix=prefix)
    compress_theta = _float(theta, "compress_rope_theta", default=160000.0, prefix=prefix)

    if t.get("rope_scaling"):
        yarn = _yarn(t["rope_scaling"], prefix + "rope_scaling")
    else:
        yarn = _yarn({k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                                    "attention_factor")} or None,
                     prefix + "rope_parameters")
    return dict(rope_dim=r, rope_theta=rope_theta, compress_rope_theta=compress_theta, rope_scaling=yarn)


# ---------------------------------------------------------------------------------------------
# V4
# ---------------------------------------------------------------------------------------------


def _parse_v4(raw: dict) -> ModelConfig:
    t = raw
    kw = _common_kwargs(t, "")
    L = kw["num_layers"]
    kw.update(_rope_fields(t, "", kw["head_dim"]))

    rates = dict(_V4_DEFAULT_RATES)
    if t.get("compress_rates") is not None:
        if not isinstance(t["compress_rates"], dict):
            _fail("compress_rates", f"must be an object {{layer_type: rate}}, got {t['compress_rates']!r}")
        for k, v in t["compress_rates"].items():
            if k not in (CSA, HCA):
                _fail("compress_rates", f"keys must be {CSA!r} or {HCA!r}, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(f"compress_rates.{k}", f"must be an integer >= 1, got {v!r}")
            rates[k] = v
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if t.get(legacy) is not None:
            rates[kind] = _int(t, legacy)
    if rates[CSA] == rates[HCA]:
        _fail("compress_rates", f"CSA and HCA rates must differ, got {rates}")

    legacy = t.get("compress_ratios")
    if legacy is not None:
        legacy = _int_list(t, "compress_ratios", "", low=0)
        if len(legacy) < L:
            _fail("compress_ratios", f"needs at least num_hidden_layers={L} entries, got {len(legacy)}")
    types = t.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != L:
            _fail("layer_types", f"must be a list of length num_hidden_layers={L}, got {types!r}")
        for x in types:
            if x not in _V4_KIND:
                _fail("layer_types", f"entries must be one of {sorted(_V4_KIND)}, got {x!r}")
        ratios = [0 if x == SWA else rates[x] for x in types]
        if legacy is not None and legacy[:L] != ratios:
            _fail("compress_ratios", f"{legacy[:L]} disagrees with layer_types/compress_rates {ratios}")
    elif legacy is not None:
        by_rate = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
        types = []
        for i, m in enumerate(legacy[:L]):  # entries past L describe the nextn (MTP) layers
            if m not in by_rate:
                _fail(f"compress_ratios[{i}]", f"must be one of {sorted(by_rate)}, got {m}")
            types.append(by_rate[m])
    else:
        # TF default: 2 x HCA, then alternating HCA / CSA
        types = [HCA] * min(L, 2) + [CSA if i % 2 else HCA for i in range(max(L - 2, 0))]
    ratios = [0 if x == SWA else rates[x] for x in types]

    mlp = t.get("mlp_layer_types")
    if mlp is not None:
        if not isinstance(mlp, list) or len(mlp) != L:
            _fail("mlp_layer_types", f"must be a list of length num_hidden_layers={L}, got {mlp!r}")
        for x in mlp:
            if x not in ("hash_moe", "moe"):
                _fail("mlp_layer_types", f"entries must be 'hash_moe' or 'moe', got {x!r}")
        hash_moe = [x == "hash_moe" for x in mlp]
    else:
        n_hash = _int(t, "num_hash_layers", low=0, default=_V4_DEFAULT_HASH_LAYERS)
        hash_moe = [i < n_hash for i in range(L)]

    if t.get("hc_shifted", False):
        _fail("hc_shifted", "must be false for deepseek_v4 (V4 uses the unshifted pre-mix and the HC head)")
    eos = _eos(t.get("eos_token_id", 1), "eos_token_id")
    return ModelConfig(
        model_type=V4,
        **kw,
        bos_token_id=_opt_token(t, "bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=_opt_token(t, "pad_token_id"),
        torch_dtype=_dtype(raw, {}),
        compress_ratios=ratios,
        layer_kinds=[_V4_KIND[x] for x in types],
        hash_moe=hash_moe,
        hc_shifted=False,
        n_prefill_layer=L,
        quant=_quant(raw.get("quantization_config")),
    )


# ---------------------------------------------------------------------------------------------
# V4.1
# ---------------------------------------------------------------------------------------------


def _parse_v41(raw: dict) -> ModelConfig:
    arch = raw.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
        _fail("architectures", f"must hold exactly one name, got {arch!r}")
    t = raw.get("text_config")
    if not isinstance(t, dict):
        _fail("text_config", "missing (required for deepseek_v41)")
    p = "text_config."
    kw = _common_kwargs(t, p)
    L = kw["num_layers"]
    nextn = kw["num_nextn_predict_layers"]
    kw.update(_rope_fields(t, p, kw["head_dim"]))

    ratios_all = _int_list(t, "compress_ratios", p, low=0, high=2)
    if len(ratios_all) != L + nextn:
        _fail(p + "compress_ratios", f"length must be num_hidden_layers + num_nextn_predict_layers = {L + nextn}, "
                                     f"got {len(ratios_all)}")
    ratios = ratios_all[:L]  # draft layers are SWA-only whatever their entry says (DI _dflash_spec)

    kv_ids = _int_list(t, "kv_source_layer_ids", p, 0, L - 1, default=[])
    index_ids = _int_list(t, "index_source_layer_ids", p, 0, L - 1, default=[])
    index_k_ids = _int_list(t, "index_k_source_layer_ids", p, 0, L - 1, default=list(kv_ids))

    cand = t.get("candidate_source_layer_id")
    cand_blocks = cand_size = None
    if cand is not None:
        cand = _int(t, "candidate_source_layer_id", low=0, prefix=p)
        if cand >= L:
            _fail(p + "candidate_source_layer_id", f"must be in [0, {L - 1}], got {cand}")
        cand_blocks = _int(t, "candidate_topk_blocks", prefix=p)
        cand_size = _int(t, "candidate_block_size", prefix=p)

    engram_ids = _int_list(t, "engram_layer_ids", p, 0, L - 1, default=[])
    engram = {}
    if engram_ids:
        engram = dict(
            engram_max_ngram_size=_int(t, "engram_max_ngram_size", low=2, prefix=p),
            engram_vocab_size=_int(t, "engram_vocab_size", low=2, prefix=p),
            engram_n_heads=_int(t, "engram_n_heads", prefix=p),
            engram_head_dim=_int(t, "engram_head_dim", prefix=p),
            engram_compressed_vocab=bool(t.get("engram_compressed_vocab_size")),
            engram_pad_token_id=_int(t, "engram_pad_token_id", low=0, default=raw.get("pad_token_id"), prefix=p),
        )

    dspark = {}
    if nextn:
        if t.get("dspark_target_attn_input", True) is not True:
            _fail(p + "dspark_target_attn_input", "must be true (DI asserts it)")
        dspark = dict(
            dspark_block_size=_int(t, "dspark_block_size", prefix=p),
            dspark_target_layer_ids=_int_list(t, "dspark_target_layer_ids", p, 0, L - 1),
            dspark_markov_rank=_int(t, "dspark_markov_rank", prefix=p),
            dspark_noise_token_id=_int(t, "dspark_noise_token_id", low=0, prefix=p),
            dspark_n_routed_experts=_int(t, "dspark_n_routed_experts", prefix=p),
            dspark_num_experts_per_tok=_int(t, "dspark_num_experts_per_tok", prefix=p),
        )
        if not dspark["dspark_target_layer_ids"]:
            _fail(p + "dspark_target_layer_ids", "must be non-empty when num_nextn_predict_layers > 0")

    ones = [i for i, m in enumerate(ratios) if m == 1]
    cfg = ModelConfig(
        model_type=V41,
        **kw,
        bos_token_id=_opt_token(raw, "bos_token_id"),
        eos_token_ids=_eos(raw.get("eos_token_id"), "eos_token_id"),
        pad_token_id=_opt_token(raw, "pad_token_id"),
        torch_dtype=_dtype(raw, t),
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
        quant=_quant(raw.get("quantization_config")),
    )
    return cfg


def _validate_v41(c: ModelConfig) -> None:
    p = "text_config."
    L, ratios = c.num_layers, c.compress_ratios
    lists = {"kv_source_layer_ids": c.kv_source_layer_ids, "index_source_layer_ids": c.index_source_layer_ids,
             "index_k_source_layer_ids": c.index_k_source_layer_ids}
    maps = {"kv_source_layer_ids": c.kv_source_map, "index_source_layer_ids": c.index_source_map,
            "index_k_source_layer_ids": c.index_k_source_map}
    for key, ids in lists.items():
        for s in ids:
            if ratios[s] == 0:
                _fail(p + key, f"source layer {s} has compress ratio 0; sources need ratio 1 or 2")
    all_ids = [s for ids in lists.values() for s in ids]
    if all_ids:
        first = min(all_ids)
        for layer in range(first, L):
            if ratios[layer] == 0:
                _fail(f"{p}compress_ratios[{layer}]", f"ratio 0 after the first source layer {first}; "
                                                      "allowed values there: 1 or 2")
    for key, m in maps.items():
        for layer in range(L):
            if ratios[layer] and ratios[m[layer]] != ratios[layer]:
                _fail(p + key, f"layer {layer} (ratio {ratios[layer]}) maps to source {m[layer]} "
                               f"with ratio {ratios[m[layer]]}; a layer and its source need the same ratio")

    def effective(m: list[int]) -> set[int]:
        return {layer for layer in range(L) if ratios[layer] and m[layer] == layer}

    kv, idx, idx_k = effective(c.kv_source_map), effective(c.index_source_map), effective(c.index_k_source_map)
    if not kv <= idx_k:
        _fail(p + "index_k_source_layer_ids", f"kv sources {sorted(kv)} must be index-K sources {sorted(idx_k)}")
    if not idx_k <= idx:
        _fail(p + "index_source_layer_ids", f"index-K sources {sorted(idx_k)} must be index sources {sorted(idx)}")
    if idx_k != kv:
        # §8 item 8: index keys come from the layer's own pre-RoPE latent, so they need a kv source
        _fail(p + "index_k_source_layer_ids", f"index-K sources {sorted(idx_k)} must equal kv sources {sorted(kv)}")
    if c.n_prefill_layer < L and c.n_prefill_layer not in kv:
        _fail(p + "kv_source_layer_ids", f"the first YOCO layer {c.n_prefill_layer} (first ratio-1 layer) "
                                         f"must be a kv source, got {sorted(kv)}")
    if c.rope_dim != 64:
        _fail(p + "qk_rope_head_dim", f"must be 64 (the V4.1 indexer RoPE width), got {c.rope_dim}")

    cs = c.candidate_source_layer_id
    if cs is not None:
        if cs not in idx:
            _fail(p + "candidate_source_layer_id", f"{cs} must be an index source with ratio > 0 {sorted(idx)}")
        if c.candidate_topk_blocks % 8:
            _fail(p + "candidate_topk_blocks", f"must be a positive multiple of 8, got {c.candidate_topk_blocks}")
        if not 0 < c.candidate_block_size <= 16:
            _fail(p + "candidate_block_size", f"must be in [1, 16], got {c.candidate_block_size}")
        for layer in range(cs + 1, L):
            if ratios[layer] != ratios[cs]:
                _fail(f"{p}compress_ratios[{layer}]", f"must equal the candidate source's ratio {ratios[cs]} "
                                                      f"(layers after {cs}), got {ratios[layer]}")
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:
            _fail(p + "candidate_topk_blocks", f"candidate_topk_blocks * candidate_block_size = "
                                               f"{c.candidate_topk_blocks * c.candidate_block_size} < index_topk "
                                               f"{c.index_topk}")
        if any(layer > cs for layer in idx):
            if c.index_n_heads > 32:
                _fail(p + "index_n_heads", f"must be <= 32 with a candidate prefilter, got {c.index_n_heads}")
            if c.index_head_dim != 128:
                _fail(p + "index_head_dim", f"must be 128 with a candidate prefilter, got {c.index_head_dim}")
            if c.candidate_block_size not in (8, 16):
                _fail(p + "candidate_block_size", f"must be 8 or 16 with a filtered index layer, "
                                                  f"got {c.candidate_block_size}")
            if c.candidate_topk_blocks > 4096:
                _fail(p + "candidate_topk_blocks", f"must be <= 4096, got {c.candidate_topk_blocks}")

    if c.engram_layer_ids and c.engram_head_dim % 32:
        _fail(p + "engram_head_dim", f"must be a multiple of 32 (1x32 table scales), got {c.engram_head_dim}")
    if c.num_nextn_predict_layers:
        if c.dspark_num_experts_per_tok > c.dspark_n_routed_experts:
            _fail(p + "dspark_num_experts_per_tok", f"must be <= dspark_n_routed_experts "
                                                    f"{c.dspark_n_routed_experts}, got {c.dspark_num_experts_per_tok}")
        if c.dspark_noise_token_id >= c.vocab_size:
            _fail(p + "dspark_noise_token_id", f"must be < vocab_size {c.vocab_size}, got {c.dspark_noise_token_id}")

    if c.quant is not None:
        # §1.3 tiling: every FP8 weight dim and every expert in-dim is a multiple of 32
        dims = {"hidden_size": c.hidden_size, "q_lora_rank": c.q_lora_rank, "head_dim": c.head_dim,
                "moe_intermediate_size": c.moe_inter_size, "o_lora_rank": c.o_lora_rank * c.o_groups,
                "num_attention_heads * head_dim / o_groups": c.num_heads * c.head_dim // c.o_groups,
                "index_n_heads * index_head_dim": c.index_n_heads * c.index_head_dim}
        for key, v in dims.items():
            if v % 32:
                _fail(p + key.split(" ")[0], f"{key} = {v} must be a multiple of 32 for FP8/FP4 weights")


def _validate_common(c: ModelConfig) -> None:
    p = "text_config." if c.is_v41 else ""
    if c.num_heads % c.o_groups:
        _fail(p + "o_groups", f"must divide num_attention_heads {c.num_heads}, got {c.o_groups}")
    if c.rope_dim % 2 or c.rope_dim > c.head_dim or c.rope_dim > c.index_head_dim or c.rope_dim <= 0:
        _fail(p + "qk_rope_head_dim", f"must be even and in [2, min(head_dim, index_head_dim) = "
                                      f"{min(c.head_dim, c.index_head_dim)}], got {c.rope_dim}")
    if c.n_experts_per_tok > c.n_routed_experts:
        _fail(p + "num_experts_per_tok", f"must be <= n_routed_experts {c.n_routed_experts}, "
                                         f"got {c.n_experts_per_tok}")
    for key, ids in (("engram_layer_ids", c.engram_layer_ids), ("dspark_target_layer_ids", c.dspark_target_layer_ids)):
        for s in ids:
            if not 0 <= s < c.num_layers:
                _fail(p + key, f"entries must be in [0, {c.num_layers - 1}], got {s}")
    for key, tok in (("bos_token_id", c.bos_token_id), ("pad_token_id", c.pad_token_id)):
        if tok is not None and tok >= c.vocab_size:
            _fail(key, f"must be < vocab_size {c.vocab_size}, got {tok}")
    for tok in c.eos_token_ids:
        if tok >= c.vocab_size:
            _fail("eos_token_id", f"must be < vocab_size {c.vocab_size}, got {tok}")
