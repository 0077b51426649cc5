"""Safetensors checkpoint -> dense tensors under the canonical names (docs/model.md §2).

Accepts one `model.safetensors`, shards with `model.safetensors.index.json`, or a folder of shards;
names with or without a `model.` prefix; official DeepSeek names and transformers names (docs/model.md
§2.3, including the stacked `experts.gate_up_proj` / `down_proj`). Dequantizes FP8 weights (scale as
`X.scale` ue8m0 / f32 or `X.weight_scale_inv`), packed FP4 experts and the Engram table (zero rows
appended up to the model's row count; a table padded to a multiple of 256 rows is cut back).
Vision tensors are ignored. Anything missing, unknown or malformed raises ValueError naming the
tensor with the expected and the found shape / dtype; nothing is loaded until the whole plan checks.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer.model_executor.layers.quant import dequant_fp4, dequant_fp8_block, float_to_ue8m0, infer_block_size
from deepinfer.model_executor.shard_plan import code_regions, read_slice

INDEX_FILE = "model.safetensors.index.json"
VISION_PREFIXES = ("vision.", "aligner.", "image_", "vision_pipeline.")
ENGRAM_ROW_ALIGN = 256  # DI pads Engram tables to a multiple of 256 rows (engram_parameters.py)

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}

# DSpark head tensors that DI reads from one mtp index only; copies at other indices are ignored
# (docs/model.md §2.2, §8 item 5), as are the tied mtp embed/head copies.
_MTP_OPTIONAL = re.compile(r"^mtp\.\d+\.(main_proj\.|main_norm\.|markov_head\.|confidence_head\.|norm\.|hc_head_|"
                           r"embed\.weight$|head\.weight$)")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_EXPERT_STACK = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")   # transformers' stacked experts


def is_fp32_tensor(name: str) -> bool:
    """Tensors kept in fp32 whatever the compute dtype (docs/model.md §2.1)."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf.startswith("hc_") and leaf.endswith(("_fn", "_base", "_scale"))) or leaf == "attn_sink" \
        or name.endswith(("ffn.gate.bias", "ffn.gate.bias_vl"))


# ---------------------------------------------------------------------------------------------
# transformers names -> canonical names (inverse of TF conversion_mapping["deepseek_v4"])
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# stored tensors
# ---------------------------------------------------------------------------------------------


@dataclass
class _Stored:
    key: str  # name in the file
    file: str
    dtype: torch.dtype
    shape: tuple

    def describe(self) -> str:
        return f"shape {self.shape} dtype {_dtype_name(self.dtype)} ({self.key!r} in {self.file})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scan(model_dir: Path) -> dict[str, _Stored]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: 'weight_map' must be a non-empty object")
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        weight_map = None
        if not files:
            raise ValueError(f"no safetensors files (or {INDEX_FILE}) in {model_dir}")
    stored: dict[str, _Stored] = {}
    for fname in files:
        path = model_dir / fname
        if not path.is_file():
            raise ValueError(f"{INDEX_FILE} lists shard {fname!r}, which does not exist in {model_dir}")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if weight_map is not None and weight_map.get(key) != fname:
                    continue  # the index decides which shard holds a tensor
                if key in stored:
                    raise ValueError(f"tensor {key!r} is stored twice ({stored[key].file} and {fname})")
                sl = f.get_slice(key)
                st_dtype = sl.get_dtype()
                if st_dtype not in _ST_DTYPES:
                    raise ValueError(f"tensor {key!r} in {fname}: unsupported dtype {st_dtype}")
                stored[key] = _Stored(key, fname, _ST_DTYPES[st_dtype], tuple(sl.get_shape()))
    if weight_map is not None:
        for key, fname in weight_map.items():
            if key not in stored:
                raise ValueError(f"{INDEX_FILE} lists tensor {key!r} in {fname!r}, but that file does not hold it")
    return stored


def _canonical_names(stored: dict[str, _Stored]) -> tuple[dict[str, _Stored], int]:
    """Canonical name -> stored tensor (scales keep their suffix); vision tensors dropped."""
    out: dict[str, _Stored] = {}
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


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One stored tensor (plus scale) and the canonical outputs cut from its value: the dense value,
    or (raw) its stored codes, with the same cut applied to the scale for `scale_outputs`."""
    src: _Stored
    scale: _Stored | None
    fmt: str  # dense | int | fp8 | fp4
    outputs: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    raw: bool = False
    scale_outputs: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    cuts: tuple = ()        # shard_plan.Cut (dense coordinates) this rank reads (attention lanes)
    experts: range | None = None  # stacked experts: the expert rows this rank reads (expert parallelism)


def _spec(value: Any) -> tuple[tuple, torch.dtype]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
        return tuple(value[0]), value[1]
    return tuple(value.shape), value.dtype


def _fmt(name: str, st: _Stored, scale: _Stored | None, exp_dtype: torch.dtype) -> str:
    """Storage format, or ValueError when dtype and scale do not fit together."""
    want = f"expected dtype {_dtype_name(exp_dtype)}, found {st.describe()}"
    if st.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError(f"tensor {name!r}: float8_e4m3fn weight without a scale (.scale or .weight_scale_inv); "
                             f"{want}")
        kind = "fp8"
    elif st.dtype in (torch.int8, torch.uint8) and (exp_dtype.is_floating_point or exp_dtype == torch.uint8):
        if scale is None:
            raise ValueError(f"tensor {name!r}: packed fp4 (int8) weight without a scale; {want}")
        kind = "fp4"
    elif st.dtype.is_floating_point:
        if scale is not None:
            raise ValueError(f"tensor {name!r}: has a scale {scale.key!r} but is not fp8/fp4; {want}")
        if st.dtype == torch.float8_e8m0fnu:
            raise ValueError(f"tensor {name!r}: ue8m0 is a scale format, not a weight; {want}")
        kind = "dense"
    else:
        kind = "int"
    if exp_dtype == torch.uint8:   # the model keeps this weight packed (layers/packed_weights.py)
        if kind not in ("fp8", "fp4"):
            raise ValueError(f"tensor {name!r}: the model keeps it packed (weight_format='packed') but the "
                             f"checkpoint stores it unquantized, {st.describe()}; use weight_format='dense'")
        return kind
    if (kind == "int") == exp_dtype.is_floating_point:
        raise ValueError(f"tensor {name!r}: {want}")
    if scale is not None and scale.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32,
                                                 torch.bfloat16, torch.float16):
        raise ValueError(f"tensor {name!r}: scale {scale.key!r} has dtype {_dtype_name(scale.dtype)}; "
                         "expected float8_e8m0fnu, uint8 or a float dtype")
    if is_fp32_tensor(name) and st.dtype != torch.float32:
        raise ValueError(f"tensor {name!r}: must be stored as float32 (docs/model.md §2.1); {want}")
    return kind


def _dense_shape(name: str, st: _Stored, scale: _Stored | None, kind: str, hint) -> tuple:
    """The dense shape a stored tensor decodes to (after checking its scale grid)."""
    if kind == "fp8":
        if len(st.shape) < 2:
            raise ValueError(f"tensor {name!r}: fp8 weight must be >= 2-D, found {st.describe()}")
        try:
            infer_block_size(st.shape, scale.shape, hint)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: scale {scale.key!r} shape {scale.shape} does not fit "
                             f"{st.describe()}: {e}") from None
        return st.shape
    if kind == "fp4":
        cols = 2 * st.shape[-1] if st.shape else 0
        ok = (len(st.shape) >= 2 and len(scale.shape) == len(st.shape) and scale.shape[:-1] == st.shape[:-1]
              and scale.shape[-1] > 0 and cols % scale.shape[-1] == 0)
        if not ok:
            raise ValueError(f"tensor {name!r}: fp4 scale {scale.key!r} shape {scale.shape} does not fit packed "
                             f"{st.describe()}; expected [.., rows, cols / group]")
        return (*st.shape[:-1], cols)
    return st.shape


def _check_shape(name: str, found: tuple, exp_shape: tuple, exp_dtype: torch.dtype, st: _Stored) -> None:
    if tuple(found) != tuple(exp_shape):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} dtype {_dtype_name(exp_dtype)}, "
                         f"found {st.describe()} (dense shape {tuple(found)})")


def _engram_rows(name: str, found: tuple, exp_shape: tuple, exp_dtype, st: _Stored) -> Callable:
    """Cut or zero-pad an Engram table to the model's rows (docs/model.md §2.1, §2.2)."""
    rows, want = found[0], exp_shape[0]
    if len(found) != 2 or found[1] != exp_shape[1] or (rows > want and rows > -(-want // ENGRAM_ROW_ALIGN)
                                                      * ENGRAM_ROW_ALIGN):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} (rows may be padded to a multiple "
                         f"of {ENGRAM_ROW_ALIGN}) dtype {_dtype_name(exp_dtype)}, found {st.describe()}")

    def fix(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] >= want:
            return t[:want]
        return torch.cat([t, t.new_zeros(want - t.shape[0], t.shape[1])])

    return fix


def _bind_scales(names: dict[str, _Stored]) -> tuple[dict[str, _Stored], dict[str, _Stored]]:
    """(weights and other tensors, weight name -> its scale) of a checkpoint's canonical names."""
    scales: dict[str, _Stored] = {}
    tensors: dict[str, _Stored] = {}
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


def _plan(names: dict[str, _Stored], expected: dict[str, tuple[tuple, torch.dtype]], hint, plan=None,
          skip: frozenset = frozenset(), partial: bool = False) -> list[_Item]:
    """plan: a rank's ShardPlan (model_executor/shard_plan.py): `expected` then holds its slices' shapes
    and only its experts; the checkpoint's full shapes are checked against the plan's full sizes.
    skip: stored tensors not to load (the caller fills them); partial: `expected` is a subset, so the
    checkpoint's other tensors are not errors."""
    tensors, scales = _bind_scales(names)

    items: list[_Item] = []
    used: set[str] = set()
    stacked: dict[str, _Item] = {}
    missing = []
    # packed weights: `X.scale` is an output of the `X.weight` item, not a tensor of its own
    packed_scales = {n for n in expected if n.endswith(".scale") and expected.get(n[: -len(".scale")] + ".weight",
                                                                               (None, None))[1] == torch.uint8}
    for name, (exp_shape, exp_dtype) in expected.items():
        if name in packed_scales:
            continue
        raw = exp_dtype == torch.uint8
        st = tensors.get(name)
        if st is not None:
            used.add(name)
            sc = scales.get(name)
            kind = _fmt(name, st, sc, exp_dtype)
            found = _dense_shape(name, st, sc, kind, hint)
            dense_exp = _dense_of_packed(exp_shape, kind) if raw else exp_shape
            cuts = plan.cuts(name) if plan is not None else ()
            if cuts:   # the checkpoint holds the full tensor: check it against the full sizes
                if kind == "fp4":
                    raise ValueError(f"tensor {name!r}: no sliced form of a packed fp4 weight")
                full = {c.dim: c.full for c in cuts}
                dense_exp = tuple(full.get(d, n) for d, n in enumerate(dense_exp))
            if name.endswith("engram.embed.weight"):
                fix = _engram_rows(name, found, dense_exp, exp_dtype, st)
            else:
                _check_shape(name, found, dense_exp, exp_dtype, st)
                fix = _identity
            item = _Item(st, sc, kind, [(name, fix)], raw=raw, cuts=cuts)
            if raw:
                item.scale_outputs.append((name[: -len(".weight")] + ".scale", fix))
            items.append(item)
            continue
        m = _EXPERT.match(name)
        key = None
        if m is not None:
            key = f"{m.group(1)}.ffn.experts.{'down_proj' if m.group(3) == 'w2' else 'gate_up_proj'}"
        if key is None or key not in tensors:
            missing.append(f"{name!r} (shape {tuple(exp_shape)} dtype {_dtype_name(exp_dtype)})")
            continue
        used.add(key)
        item = stacked.get(key)
        st, sc = tensors[key], scales.get(key)
        if item is None:
            held = plan.moe_experts(name) if plan is not None else None
            item = _Item(st, sc, _fmt(key, st, sc, exp_dtype), raw=raw, experts=held)
            stacked[key] = item
            items.append(item)
        found = _dense_shape(key, st, sc, item.fmt, hint)
        expert, which = int(m.group(2)), m.group(3)
        row = expert - (item.experts.start if item.experts is not None else 0)   # in the rows read
        if raw:
            exp_shape = _dense_of_packed(exp_shape, item.fmt)
        rows = exp_shape[0]
        want = (expert + 1, 2 * rows, exp_shape[1]) if which != "w2" else (expert + 1, *exp_shape)
        if len(found) != 3 or found[0] < want[0] or tuple(found[1:]) != tuple(want[1:]):
            raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} dtype {_dtype_name(exp_dtype)} "
                             f"(from stacked {key!r} [E>{expert}, {want[1]}, {want[2]}]), found {st.describe()}")
        if which == "w1":
            cut = lambda t, e=row, r=rows: t[e, :r]  # noqa: E731
        elif which == "w3":
            cut = lambda t, e=row, r=rows: t[e, r:]  # noqa: E731
        else:
            cut = lambda t, e=row: t[e]  # noqa: E731
        item.outputs.append((name, cut))
        if raw:
            if item.fmt != "fp4":   # a row cut of an fp8 block grid would split blocks
                raise ValueError(f"tensor {name!r}: stacked fp8 experts cannot be kept packed; use "
                                 f"weight_format='dense'")
            item.scale_outputs.append((name[: -len(".weight")] + ".scale", cut))
    if missing:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}{more}")

    for key, item in stacked.items():
        n_experts = item.src.shape[0]
        got = {int(_EXPERT.match(n).group(2)) for n, _ in item.outputs}
        if item.experts is not None:   # a rank of an EP group: the file holds every expert, we read ours
            if n_experts != plan.moe_size(key) or got != set(item.experts):
                raise ValueError(f"tensor {key!r}: stacked {n_experts} experts, the model has "
                                 f"{plan.moe_size(key)} (this rank reads {item.experts}); found {item.src.describe()}")
            continue
        if len(got) != n_experts:
            raise ValueError(f"tensor {key!r}: stacked {n_experts} experts but the model expects {len(got)}; "
                             f"found {item.src.describe()}")

    has_mtp = any(n.startswith("mtp.") for n in expected)
    extra = []
    for name, st in tensors.items():
        if name in used or name in skip or partial:
            continue
        if name.startswith("mtp.") and (not has_mtp or _MTP_OPTIONAL.match(name)):
            continue  # drafting tensors the model does not build (V4 MTP; DSpark head copies)
        if plan is not None and not plan.holds(name):
            continue  # another EP rank's expert
        extra.append(f"{name!r} ({st.describe()})")
    if extra:
        more = f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""
        raise ValueError(f"checkpoint has {len(extra)} unexpected tensor(s): {', '.join(extra[:10])}{more}")
    return items


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _dense_of_packed(codes_shape: tuple, kind: str) -> tuple:
    """Dense shape of a packed weight's codes: fp4 holds two values per byte."""
    return (*codes_shape[:-1], 2 * codes_shape[-1]) if kind == "fp4" else tuple(codes_shape)


def _regions(item: _Item, hint, packed: bool) -> tuple[dict, dict, dict]:
    """What of the item's codes and scale this rank reads, and what to cut after decoding
    (model_executor/shard_plan.py); empty for a whole tensor."""
    if item.experts is not None:
        rows = {0: (item.experts.start, item.experts.stop)}
        return rows, rows, {}
    if not item.cuts:
        return {}, {}, {}
    if item.fmt != "fp8":
        return {c.dim: (c.start, c.stop) for c in item.cuts}, {}, {}
    block = infer_block_size(item.src.shape, item.scale.shape, hint)
    return code_regions(item.src.key, item.cuts, block, packed)


def _read(f, st: _Stored, region: dict) -> torch.Tensor:
    return read_slice(f, st.key, len(st.shape), region)


def _raw(item: _Item, f_src, f_scale, hint=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed item's stored codes and ue8m0 exponents, both as uint8 bytes."""
    code_region, scale_region, _ = _regions(item, hint, packed=True)
    codes = _read(f_src, item.src, code_region).view(torch.uint8)
    s = _read(f_scale, item.scale, scale_region)
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return codes, s.view(torch.uint8)
    try:   # float scales: exact powers of two become ue8m0 bytes, anything else cannot stay packed
        return codes, float_to_ue8m0(s).view(torch.uint8)
    except ValueError:
        raise ValueError(f"tensor {item.src.key!r}: its scale {item.scale.key!r} is not a power of two, which "
                         f"packed weights need (ue8m0); use weight_format='dense'") from None


def _decode(item: _Item, f_src, f_scale, hint) -> torch.Tensor:
    code_region, scale_region, trim = _regions(item, hint, packed=False)
    t = _read(f_src, item.src, code_region)
    if item.fmt == "fp8":
        s = _read(f_scale, item.scale, scale_region)
        block = infer_block_size(item.src.shape, item.scale.shape, hint)   # the stored tensor's grid
        t = dequant_fp8_block(t, s, block)
        for dim, (start, size) in trim.items():   # dense slices read whole blocks (shard_plan.covering)
            t = t.narrow(dim, start, size)
        return t
    if item.fmt == "fp4":
        return dequant_fp4(t, _read(f_scale, item.scale, scale_region))
    return t


def _block_hint(model_dir: Path) -> tuple[int, int] | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        q = json.loads(path.read_text()).get("quantization_config") or {}
        block = q.get("weight_block_size")
        return (int(block[0]), int(block[1])) if block else None
    except (ValueError, TypeError, IndexError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def stored_formats(model_dir: str | Path) -> dict:
    """Canonical weight name -> WeightFormat of every tensor the checkpoint stores quantized with ue8m0
    scales, read from the file headers only: what weight_format="packed" keeps as it is stored.
    fp8 tensors with float scales and stacked fp8 experts are left out (they load dense)."""
    from deepinfer.model_executor.layers.packed_weights import WeightFormat
    model_dir = Path(model_dir)
    names, _ = _canonical_names(_scan(model_dir))
    tensors, scales = _bind_scales(names)
    hint = _block_hint(model_dir)
    out = {}
    for name, st in tensors.items():
        sc = scales.get(name)
        if sc is None or sc.dtype not in (torch.float8_e8m0fnu, torch.uint8) or len(st.shape) < 2:
            continue
        if st.dtype == torch.float8_e4m3fn:
            if _EXPERT_STACK.search(name):
                continue
            block = infer_block_size(st.shape, sc.shape, hint)
            table = name.endswith("engram.embed.weight")
            if table and block[0] != 1:
                continue
            out[name] = WeightFormat("fp8_table" if table else "fp8", block)
        elif st.dtype in (torch.int8, torch.uint8) and 2 * st.shape[-1] % sc.shape[-1] == 0:
            fmt = WeightFormat("fp4", (1, 2 * st.shape[-1] // sc.shape[-1]))
            m = _EXPERT_STACK.search(name)
            if m is None:
                out[name] = fmt
                continue
            base = name[: m.start()]
            leaves = ("w2",) if m.group(1) == "down_proj" else ("w1", "w3")
            for e in range(st.shape[0]):
                for leaf in leaves:
                    out[f"{base}.experts.{e}.{leaf}.weight"] = fmt
    return out


def load_weights(model_dir: str | Path, expected: Mapping[str, Any], dtype: torch.dtype | None = None,
                 progress: bool = True, plan=None, skip=(), partial: bool = False) -> dict[str, torch.Tensor]:
    """Read, rename and dequantize a checkpoint into {canonical name: dense tensor}.

    expected: canonical name -> anything with `.shape` and `.dtype` (a tensor, a meta tensor, or a
    `(shape, dtype)` tuple such as `tiny_checkpoint.expected_tensor_specs(cfg)`).
    dtype: output dtype of float tensors; the fp32 tensors of docs/model.md §2.1 stay fp32. None keeps
    each expected tensor's own dtype. Integer tensors (tid2eid) take the expected dtype.
    plan: a rank's ShardPlan: only its slices and experts are read (get_slice), never a whole sharded
    tensor; `expected` then lists the rank's own shapes (its model's state_dict).
    skip: canonical names the checkpoint stores that are not read (e.g. Engram tables mapped from
    shared memory, distributed/shared_tables.py); partial: load only `expected`, whatever else is stored.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} is not a directory")
    specs = {name: _spec(v) for name, v in expected.items()}
    names, _ = _canonical_names(_scan(model_dir))
    hint = _block_hint(model_dir)
    items = _plan(names, specs, hint, plan, frozenset(skip), partial)

    out: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    bar = tqdm(total=len(specs), desc="Loading weights", unit="tensor", disable=not progress)
    try:
        for item in items:
            for st in (item.src, item.scale):
                if st is not None and st.file not in handles:
                    handles[st.file] = safe_open(str(model_dir / st.file), framework="pt")
            f_scale = handles[item.scale.file] if item.scale else None
            if item.raw:
                codes, exps = _raw(item, handles[item.src.file], f_scale, hint)
                for name, cut in item.outputs:
                    out[name] = cut(codes).contiguous()
                    bar.update(1)
                for name, cut in item.scale_outputs:
                    out[name] = cut(exps).contiguous()
                    _check_shape(name, tuple(out[name].shape), specs[name][0], torch.uint8, item.scale)
                    bar.update(1)
                continue
            dense = _decode(item, handles[item.src.file], f_scale, hint)
            for name, cut in item.outputs:
                exp_dtype = specs[name][1]
                if not exp_dtype.is_floating_point:
                    target = exp_dtype
                elif dtype is None:
                    target = exp_dtype
                else:
                    target = torch.float32 if is_fp32_tensor(name) else dtype
                out[name] = cut(dense).to(target).contiguous()
                bar.update(1)
    finally:
        bar.close()
        handles.clear()
    return out


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype | None = None,
                    progress: bool = True, skip=()) -> dict[str, float]:
    """Fill `model` (its state_dict names are the canonical names) from `model_dir`.

    Each tensor takes the model's own dtype unless `dtype` is given (then §2.1 fp32 tensors stay fp32).
    Meta-device models are materialized by assignment. Calls `model.post_load()` afterwards if the model
    has one (e.g. to stack expert weights). Returns {"tensors", "elements", "seconds"}.
    skip: state_dict names left as the model holds them (and not read from the checkpoint).
    """
    started = time.perf_counter()
    skip = frozenset(skip)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in skip}
    plan = getattr(model, "shard_plan", None)
    weights = load_weights(model_dir, expected, dtype=dtype, progress=progress,
                           plan=plan if plan is not None and plan.sharded else None, skip=skip)
    on_meta = any(t.is_meta for t in expected.values())
    with torch.no_grad():
        result = model.load_state_dict(weights, strict=not skip, assign=on_meta or dtype is not None)
    if skip and (set(result.missing_keys) != skip or result.unexpected_keys):
        raise ValueError(f"load_checkpoint: skip names {sorted(skip - set(result.missing_keys))} are not "
                         f"tensors of the model")
    if hasattr(model, "post_load"):
        model.post_load()
    return {"tensors": len(weights), "elements": sum(math.prod(t.shape) for t in weights.values()),
            "seconds": time.perf_counter() - started}
