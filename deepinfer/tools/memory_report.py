"""Weight memory of a built model next to the same tensors in their checkpoint formats.

`memory_report(cfg)` builds `DeepseekV4Model` on the meta device (shapes and dtypes only, no storage)
and sums bytes by component:

- resident: numel * element_size of every parameter and buffer the model holds, whatever its name
  (a packed `<linear>.weight_codes` counts as much as a dense `<linear>.weight`);
- checkpoint: every canonical tensor (docs/model.md §2.2, `checkpoint_schema.tensor_shapes`) in the format
  the checkpoint stores it (docs/model.md §2.1, `checkpoint_schema.tensor_format`): fp8 e4m3 codes plus one
  scale per weight block, fp4 e2m1 experts two per byte plus one ue8m0 byte per 32 inputs, the fp8
  Engram table plus one ue8m0 byte per 32 values of a row, fp32 for the §2.1 fp32 tensors, bf16 (or
  the config dtype when unquantized) for the rest.

The checkpoint column walks the canonical list rather than the model's own names: once weights stay
packed, the model's names and shapes are its storage layout, while the checkpoint column must stay
the file's. Both columns are grouped by the same `component_of`, which reads the module path, so a
tensor and its scale (`X.weight`, `X.scale`, `X.weight_codes`, ...) land in the same component.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from deepinfer.model_executor.checkpoint_formats import BF16, DENSE, F32, FP4, FP8, INT, TABLE, unquantized
from deepinfer.model_executor.checkpoint_schema import (checkpoint_schema, expected_tensor_specs, no_weight_init,
                                                        tensor_format)

COMPONENTS = ("attention_linears", "shared_expert", "routed_experts", "embed_head", "engram_tables",
              "other_linears", "norms_hc_other")
COMPONENT_LABELS = {
    "attention_linears": "attention linears (incl. compressor, indexer)",
    "shared_expert": "shared expert",
    "routed_experts": "routed experts",
    "embed_head": "embedding and head (incl. DSpark Markov head)",
    "engram_tables": "Engram tables",
    "other_linears": "other linears (Engram wkv, DSpark main_proj / confidence)",
    "norms_hc_other": "norms, HC, router, sinks, other",
}
TARGET_RATIO = 1.05  # issue target: resident <= 1.05 x checkpoint

# Attention sub-modules whose own direct tensors are not linear weights (attn_sink, compressor ape).
_ATTN_CONTAINERS = ("attn", "compressor", "indexer")


def component_of(name: str) -> str:
    """Component of a parameter / buffer / checkpoint tensor, decided by its module path.

    The leaf (`weight`, `scale`, `weight_codes`, `_w13`, ...) only matters for tensors that sit
    directly on a container module, so new storage names of the same module classify unchanged."""
    parts = name.split(".")
    path, leaf = parts[:-1], parts[-1]
    if "shared_experts" in path:
        return "shared_expert"
    if "experts" in path or (path and path[-1] == "ffn"):
        # per-expert modules, a stacked `experts.*` holder, or stacks kept on the MoE module (`ffn._w13`)
        return "routed_experts"
    if "engram" in path:
        sub = path[path.index("engram") + 1:]
        if (sub and sub[0] == "embed") or (not sub and ("embed" in leaf or "table" in leaf)):
            return "engram_tables"
        if sub and sub[0] == "wkv":
            return "other_linears"
        return "norms_hc_other"  # q_weight / k_weight
    if "markov_head" in path:
        return "embed_head"
    if not path:  # tensors on the model itself: embed / head copies (`_head_t`), V4 hc_head_*
        return "embed_head" if "head" in leaf and not leaf.startswith("hc_") else "norms_hc_other"
    if path[0] in ("embed", "head") and len(path) == 1:
        return "embed_head"
    if "attn" in path:
        if path[-1].endswith("norm") or path[-1] in _ATTN_CONTAINERS:
            return "norms_hc_other"
        return "attention_linears"
    if path[-1] in ("main_proj", "proj"):  # DSpark main_proj, confidence_head.proj
        return "other_linears"
    return "norms_hc_other"


def empty_counts() -> dict[str, int]:
    return {c: 0 for c in COMPONENTS}


def _with_total(counts: dict[str, int]) -> dict[str, int]:
    return {**counts, "total": sum(counts[c] for c in COMPONENTS)}


# ---------------------------------------------------------------------------------------------
# resident bytes
# ---------------------------------------------------------------------------------------------


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its full name, and the Engram host tables (layers/engram_host.py),
    one per storage: a tensor held under two names, or a view into another's storage (each expert's
    weights are views of its MoE's stacks), counts once."""
    from deepinfer.model_executor.layers.engram_host import host_table_tensors
    out, seen = {}, set()
    for name, t in [*model.named_parameters(), *model.named_buffers(), *host_table_tensors(model).items()]:
        if t is None:
            continue
        key = t.untyped_storage()._cdata   # the storage itself (meta storages have no data pointer)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def resident_bytes(model: nn.Module) -> dict[str, int]:
    counts = empty_counts()
    for name, t in model_tensors(model).items():
        counts[component_of(name)] += t.untyped_storage().nbytes()
    return _with_total(counts)


def host_resident_bytes(model: nn.Module) -> int:
    """Bytes of the resident tensors that stay in host memory, never moved to the device: the Engram
    tables (layers/engram_host.py; shared once per host, distributed/shared_tables.py)."""
    from deepinfer.model_executor.layers.engram_host import host_table_tensors
    return sum(t.untyped_storage().nbytes() for t in host_table_tensors(model).values())


def config_weight_formats(cfg, fmt: CheckpointFormat | None = None) -> dict:
    """Canonical weight name -> WeightFormat of what weight_format="packed" keeps packed, from the
    config's checkpoint format (the engine reads the same from the files: loader.stored_formats)."""
    from deepinfer.model_executor.layers.packed_weights import WeightFormat
    fmt = fmt or checkpoint_format(cfg)
    if not fmt.quantized or fmt.fp8_scale_bytes != 1:   # float scales load dense
        return {}
    out = {}
    for name, spec in checkpoint_schema(cfg).items():   # one schema read: ~10^5 tensors at full size
        kind = spec.stored
        if kind == FP8:
            out[name] = WeightFormat("fp8", fmt.fp8_block)
        elif kind == FP4 and fmt.expert_dtype == "fp4":
            out[name] = WeightFormat("fp4", (1, 32))
        elif kind == TABLE:
            out[name] = WeightFormat("fp8_table", (1, 32))
    return out


# ---------------------------------------------------------------------------------------------
# checkpoint bytes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointFormat:
    quantized: bool
    fp8_block: tuple[int, int]   # rows x cols of one fp8 weight scale block
    fp8_scale_bytes: int         # 1 (ue8m0) or 4 (fp32 scales, scale_fmt "float")
    expert_dtype: str            # fp4 | fp8
    dense_dtype: str             # dtype of unquantized tensors (bf16 in quantized checkpoints)
    source: str                  # where the format came from


def checkpoint_format(cfg, dense: bool = False) -> CheckpointFormat:
    """The config's `quantization_config`; without one, DeepSeek's published V4 format (fp8 e4m3
    128x128 blocks with ue8m0 scales, fp4 experts; docs/model.md §1.3, §2.1) unless `dense`, which counts
    the checkpoint as stored unquantized in the config dtype."""
    dense_dtype = str(cfg.torch_dtype).removeprefix("torch.")
    q = cfg.quant
    if q is not None:
        return CheckpointFormat(True, tuple(q["weight_block_size"]), 1 if q["scale_fmt"] == "ue8m0" else 4,
                                q["expert_dtype"], "bfloat16", "config quantization_config")
    if dense:
        return CheckpointFormat(False, (0, 0), 0, "", dense_dtype,
                                f"unquantized {dense_dtype} (no quantization_config)")
    return CheckpointFormat(True, (128, 128), 1, "fp4", "bfloat16",
                            "assumed DeepSeek V4 release format (config has no quantization_config)")


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _fp8_bytes(shape: tuple, block: tuple[int, int], scale_bytes: int) -> int:
    *lead, rows, cols = shape
    n = math.prod(lead)
    return n * (rows * cols + math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * scale_bytes)


def _fp4_bytes(shape: tuple, group: int = 32) -> int:
    *lead, rows, cols = shape
    return math.prod(lead) * rows * (math.ceil(cols / 2) + math.ceil(cols / group))


def checkpoint_tensor_bytes(cfg, name: str, shape: tuple, fmt: CheckpointFormat) -> int:
    """Bytes of one canonical tensor (its dense shape) as the checkpoint stores it, scales included."""
    return _stored_bytes(name, shape, tensor_format(cfg, name, fmt.quantized), fmt)


def _stored_bytes(name: str, shape: tuple, kind: str, fmt: CheckpointFormat) -> int:
    n = math.prod(shape)
    if kind == INT:  # tid2eid: int64 unquantized, int32 in the quantized release (as the tiny writer)
        return n * (4 if fmt.quantized else 8)
    if kind == F32:
        return n * 4
    if kind == DENSE:
        return n * _ELEMENT_BYTES[fmt.dense_dtype]
    if kind == BF16:
        return n * 2
    if kind == FP4:
        return _fp4_bytes(shape) if fmt.expert_dtype == "fp4" else _fp8_bytes(shape, fmt.fp8_block,
                                                                               fmt.fp8_scale_bytes)
    if kind == FP8:
        return _fp8_bytes(shape, fmt.fp8_block, fmt.fp8_scale_bytes)
    if kind == TABLE:  # e4m3 rows, one ue8m0 byte per 32 values of a row
        return _fp8_bytes(shape, (1, 32), 1)
    raise ValueError(f"tensor {name!r}: unknown checkpoint format {kind!r}")


def checkpoint_bytes(cfg, fmt: CheckpointFormat | None = None) -> dict[str, int]:
    fmt = fmt or checkpoint_format(cfg)
    counts = empty_counts()
    for name, spec in checkpoint_schema(cfg).items():   # one schema read, not one per tensor
        kind = spec.stored if fmt.quantized else unquantized(spec.stored)
        counts[component_of(name)] += _stored_bytes(name, spec.shape, kind, fmt)
    return _with_total(counts)


def dense_canonical_bytes(cfg, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the canonical tensors as the loader returns them dense: §2.1 fp32 tensors in fp32,
    tid2eid int64, everything else in `dtype` (the model's form before packed weights)."""
    counts = empty_counts()
    for name, (shape, held) in expected_tensor_specs(cfg, dtype).items():
        counts[component_of(name)] += math.prod(shape) * held.itemsize
    return _with_total(counts)


# ---------------------------------------------------------------------------------------------
# meta build and report
# ---------------------------------------------------------------------------------------------


def build_meta_model(cfg, dtype: torch.dtype = torch.bfloat16, platform=None, post_load: bool = False,
                     weight_format: str = "packed", fmt: CheckpointFormat | None = None):
    """The model as the engine builds it, on the meta device: weight_format "packed" keeps the
    checkpoint's quantized tensors packed, as build_model does. post_load also runs
    `model.post_load()` (what the engine holds once weights are loaded: the stacked experts) and,
    given a platform, its `kernel_weight_layouts` (what its kernels read)."""
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    if weight_format not in ("packed", "dense"):
        raise ValueError(f"weight_format: expected 'packed' or 'dense', got {weight_format!r}")
    with torch.device("meta"), no_weight_init():
        model = DeepseekV4Model(cfg, dtype, platform=platform)
        if weight_format == "packed":
            model.use_weight_formats(config_weight_formats(cfg, fmt))
        if post_load:
            model.post_load()
            if platform is not None and weight_format == "packed":
                # the layouts the platform's kernels read, stored after loading (the Neuron platform's
                # scale values take more bytes than the checkpoint's exponents: kernel_layouts.py)
                platform.kernel_weight_layouts(model)
    return model


def memory_report(cfg, dtype: torch.dtype = torch.bfloat16, platform=None, post_load: bool = False,
                  dense_checkpoint: bool = False, model: nn.Module | None = None,
                  weight_format: str = "packed") -> dict:
    """{"dtype", "weight_format", "post_load", "checkpoint_format", "resident_bytes", "checkpoint_bytes",
    "ratio", "target_ratio", "meets_target"}; bytes are {component: n, ..., "total": n}."""
    fmt = checkpoint_format(cfg, dense=dense_checkpoint)
    if model is None:
        model = build_meta_model(cfg, dtype, platform, post_load, weight_format, fmt)
    resident = resident_bytes(model)
    host = host_resident_bytes(model)
    ckpt = checkpoint_bytes(cfg, fmt)
    ratio = resident["total"] / ckpt["total"] if ckpt["total"] else float("inf")
    return {"dtype": str(dtype).removeprefix("torch."), "weight_format": weight_format, "post_load": post_load,
            "checkpoint_format": {**asdict(fmt), "fp8_block": list(fmt.fp8_block)},
            "resident_bytes": resident, "host_bytes": host, "device_bytes": resident["total"] - host,
            "checkpoint_bytes": ckpt, "ratio": ratio,
            "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO}


def format_report(report: dict) -> str:
    """The report as a table: GiB per component, resident next to checkpoint, and their ratio."""
    gib = 2 ** 30
    res, ck = report["resident_bytes"], report["checkpoint_bytes"]
    width = max(len(v) for v in COMPONENT_LABELS.values())
    lines = [f"{'component':{width}s}  {'resident GiB':>13s}  {'checkpoint GiB':>14s}  {'ratio':>6s}"]
    for c in (*COMPONENTS, "total"):
        ratio = f"{res[c] / ck[c]:6.2f}" if ck[c] else "     -"
        label = COMPONENT_LABELS.get(c, "total")
        lines.append(f"{label:{width}s}  {res[c] / gib:13.2f}  {ck[c] / gib:14.2f}  {ratio}")
    lines.append(f"of the resident total: {report['host_bytes'] / gib:.2f} GiB host memory (Engram tables), "
                 f"{report['device_bytes'] / gib:.2f} GiB device memory")
    fmt = report["checkpoint_format"]
    lines.append(f"checkpoint format: {fmt['source']}")
    target = "meets" if report["meets_target"] else "misses"
    lines.append(f"resident / checkpoint = {report['ratio']:.3f} ({target} the <= {report['target_ratio']} target)")
    return "\n".join(lines)
