"""V4 config.json (docs/model.md §1.1) in either spelling: the official DeepSeek keys
(`compress_ratios` 0/4/128 possibly listing L + nextn entries, `num_hash_layers`) or the
transformers-normalised ones (`layer_types`, `mlp_layer_types`, `compress_rates`)."""
from __future__ import annotations

from deepinfer.config.fields import (CSA, HCA, SWA, V4, common_fields, fail, read_dtype, read_eos, read_int,
                                     read_int_list, read_quant, read_token, rope_fields)

_V4_KIND = {SWA: "swa", CSA: "csa", HCA: "hca"}
_V4_DEFAULT_RATES = {CSA: 4, HCA: 128}
_V4_DEFAULT_HASH_LAYERS = 3  # TF DeepseekV4Config.default_num_hash_layers


def parse_v4(raw: dict) -> dict:
    """The ModelConfig fields of a V4 config.json."""
    t = raw
    kw = common_fields(t, "")
    L = kw["num_layers"]
    kw.update(rope_fields(t, "", kw["head_dim"]))

    rates = dict(_V4_DEFAULT_RATES)
    if t.get("compress_rates") is not None:
        if not isinstance(t["compress_rates"], dict):
            fail("compress_rates", f"must be an object {{layer_type: rate}}, got {t['compress_rates']!r}")
        for k, v in t["compress_rates"].items():
            if k not in (CSA, HCA):
                fail("compress_rates", f"keys must be {CSA!r} or {HCA!r}, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(f"compress_rates.{k}", f"must be an integer >= 1, got {v!r}")
            rates[k] = v
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if t.get(legacy) is not None:
            rates[kind] = read_int(t, legacy)
    if rates[CSA] == rates[HCA]:
        fail("compress_rates", f"CSA and HCA rates must differ, got {rates}")

    legacy = t.get("compress_ratios")
    if legacy is not None:
        legacy = read_int_list(t, "compress_ratios", "", low=0)
        if len(legacy) < L:
            fail("compress_ratios", f"needs at least num_hidden_layers={L} entries, got {len(legacy)}")
    types = t.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != L:
            fail("layer_types", f"must be a list of length num_hidden_layers={L}, got {types!r}")
        for x in types:
            if x not in _V4_KIND:
                fail("layer_types", f"entries must be one of {sorted(_V4_KIND)}, got {x!r}")
        ratios = [0 if x == SWA else rates[x] for x in types]
        if legacy is not None and legacy[:L] != ratios:
            fail("compress_ratios", f"{legacy[:L]} disagrees with layer_types/compress_rates {ratios}")
    elif legacy is not None:
        by_rate = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
        types = []
        for i, m in enumerate(legacy[:L]):  # entries past L describe the nextn (MTP) layers
            if m not in by_rate:
                fail(f"compress_ratios[{i}]", f"must be one of {sorted(by_rate)}, got {m}")
            types.append(by_rate[m])
    else:
        # TF default: 2 x HCA, then alternating HCA / CSA
        types = [HCA] * min(L, 2) + [CSA if i % 2 else HCA for i in range(max(L - 2, 0))]
    ratios = [0 if x == SWA else rates[x] for x in types]

    mlp = t.get("mlp_layer_types")
    if mlp is not None:
        if not isinstance(mlp, list) or len(mlp) != L:
            fail("mlp_layer_types", f"must be a list of length num_hidden_layers={L}, got {mlp!r}")
        for x in mlp:
            if x not in ("hash_moe", "moe"):
                fail("mlp_layer_types", f"entries must be 'hash_moe' or 'moe', got {x!r}")
        hash_moe = [x == "hash_moe" for x in mlp]
    else:
        n_hash = read_int(t, "num_hash_layers", low=0, default=_V4_DEFAULT_HASH_LAYERS)
        hash_moe = [i < n_hash for i in range(L)]

    if t.get("hc_shifted", False):
        fail("hc_shifted", "must be false for deepseek_v4 (V4 uses the unshifted pre-mix and the HC head)")
    eos = read_eos(t.get("eos_token_id", 1), "eos_token_id")
    return dict(
        model_type=V4,
        **kw,
        bos_token_id=read_token(t, "bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=read_token(t, "pad_token_id"),
        torch_dtype=read_dtype(raw, {}),
        compress_ratios=ratios,
        layer_kinds=[_V4_KIND[x] for x in types],
        hash_moe=hash_moe,
        hc_shifted=False,
        n_prefill_layer=L,
        quant=read_quant(raw.get("quantization_config")),
    )
