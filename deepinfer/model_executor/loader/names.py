"""Stored keys -> canonical names (docs/model.md §2.2, §2.3): the `model.` prefix dropped, vision
tensors skipped, transformers names mapped back (the inverse of TF conversion_mapping["deepseek_v4"]),
and each scale bound to its weight."""
from __future__ import annotations

import re

from deepinfer.model_executor.loader.scan import Stored

VISION_PREFIXES = ("vision.", "aligner.", "image_", "vision_pipeline.")

_TF_GLOBAL = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "norm.weight": "norm.weight",
              "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_TF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
             "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale"}
_TF_ATTN = {
    "q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "kv_norm": "kv_norm",
    "o_a_proj": "wo_a", "o_b_proj": "wo_b", "sinks": "attn_sink",
    "compressor.kv_proj": "compressor.wkv", "compressor.gate_proj": "compressor.wgate",
    "compressor.position_bias": "compressor.ape", "compressor.kv_norm": "compressor.norm",
    "compressor.indexer.kv_proj": "indexer.compressor.wkv", "compressor.indexer.gate_proj": "indexer.compressor.wgate",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm": "indexer.compressor.norm",
    "compressor.indexer.q_b_proj": "indexer.wq_b", "compressor.indexer.scorer.weights_proj": "indexer.weights_proj",
}
_TF_MLP = {"gate.weight": "gate.weight", "gate.e_score_correction_bias": "gate.bias", "gate.tid2eid": "gate.tid2eid",
           "shared_experts.gate_proj": "shared_experts.w1", "shared_experts.up_proj": "shared_experts.w3",
           "shared_experts.down_proj": "shared_experts.w2",
           # stacked experts keep a marker name; the planner splits them per expert
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj"}
_TF_LAYER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm|attn_hc|ffn_hc)"
                          r"(\.|$)(.*)$")


def _sub(table: dict[str, str], rest: str) -> str | None:
    """Map `module[.leaf]` through `table` by its longest matching module prefix."""
    for key in sorted(table, key=len, reverse=True):
        if rest == key or rest.startswith(key + "."):
            return table[key] + rest[len(key):]
    return None


def tf_to_canonical(name: str) -> str | None:
    """Canonical name of a transformers-style key (without `model.`), None if it is not one."""
    if name.endswith("_scale_inv"):  # X.weight_scale_inv, experts.gate_up_proj_scale_inv
        core = tf_to_canonical(name[: -len("_scale_inv")])
        return None if core is None else core + "_scale_inv"
    if name in _TF_GLOBAL:
        return _TF_GLOBAL[name]
    m = _TF_LAYER_RE.match(name)
    if m is None:
        return None
    layer, part, rest = m.group(1), m.group(2), m.group(4)
    prefix = f"layers.{layer}."
    if part == "self_attn":
        mapped = _sub(_TF_ATTN, rest)
        return None if mapped is None else prefix + "attn." + mapped
    if part == "mlp":
        mapped = _sub(_TF_MLP, rest)
        return None if mapped is None else prefix + "ffn." + mapped
    mapped = _sub(_TF_LAYER, f"{part}.{rest}" if rest else part)
    return None if mapped is None else prefix + mapped


def canonical_names(stored: dict[str, Stored]) -> tuple[dict[str, Stored], int]:
    """Canonical name -> stored tensor (scales keep their suffix); vision tensors dropped."""
    out: dict[str, Stored] = {}
    skipped = 0
    for key, st in stored.items():
        name = key.removeprefix("model.")
        if name.startswith(VISION_PREFIXES):
            skipped += 1
            continue
        name = tf_to_canonical(name) or name
        if name in out:
            raise ValueError(f"tensor {name!r} is stored twice: {out[name].key!r} and {key!r}")
        out[name] = st
    return out, skipped


def bind_scales(names: dict[str, Stored]) -> tuple[dict[str, Stored], dict[str, Stored]]:
    """(weights and other tensors, weight name -> its scale) of a checkpoint's canonical names."""
    scales: dict[str, Stored] = {}
    tensors: dict[str, Stored] = {}
    for name, st in names.items():
        if name.endswith(".weight_scale_inv"):
            scales[name[: -len("_scale_inv")]] = st
        elif name.endswith("_scale_inv"):  # stacked TF experts: experts.gate_up_proj_scale_inv
            scales[name[: -len("_scale_inv")]] = st
        elif name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
            scales[name[: -len(".scale")] + ".weight"] = st
        else:
            tensors[name] = st
    for wname, sc in scales.items():
        if wname not in tensors:
            raise ValueError(f"scale {sc.key!r} ({sc.file}) has no weight {wname!r}")
    return tensors, scales
