"""Per-layer cache storage for every layer kind of both model types, and a bytes-per-token report.

Storage (docs/model.md §5): an SWA ring per state slot for every layer, a compressor state ring per slot
for layers that own a compressor, paged compressed entries for kv-source layers and paged index keys
for index-K sources. V4.1 layers that share a source own no storage. Block 0 and slot 0 are scratch."""
import math
from dataclasses import dataclass

import torch

from deepinfer.model_executor.forward_meta import CacheLayout
from deepinfer.model_executor.layers import quant
from deepinfer.model_executor.models.v4_attention import compressor_spec
from deepinfer.model_executor.models.v4_common import CacheFormats, ModelCache
from deepinfer.model_executor.prefix_state import comp_snapshot_rows, swa_snapshot_rows
from deepinfer.worker.kv_records import record_format


def default_block_size(cfg) -> int:
    size = 16
    for m in cfg.compress_ratios:
        if m:
            size = math.lcm(size, m)
    return size


def cache_layout(cfg, num_slots: int, block_size: int, engram_spec=None, extra_ring_rows: int = 0) -> CacheLayout:
    """extra_ring_rows: rows added to every SWA and compressor state ring (speculative_ring_rows)."""
    specs = []
    for layer in range(cfg.num_layers):
        spec = compressor_spec(cfg, layer)
        if spec is not None and spec not in specs:
            specs.append(spec)
    return CacheLayout(window=cfg.sliding_window, num_slots=num_slots, block_size=block_size,
                       compressors=specs, engram=engram_spec, extra_ring_rows=extra_ring_rows)


def speculative_ring_rows(num_speculative_tokens: int) -> int:
    """Extra ring rows per slot for B drafts a step (docs/model.md §5.3): a verification writes
    B + 1 positions past the committed length, so with R = W + B + 1 window rows (and S = ring + B + 1
    state rows, more than the ratio + B that recomputing a partial group needs) no rejected token's
    row aliases a position the next main step or draft block still reads."""
    return int(num_speculative_tokens) + 1 if num_speculative_tokens else 0


@dataclass
class StorageItem:
    kind: str        # "swa" | "state" | "entries" | "index"
    layer: int
    rows_per: int    # rows per slot (swa/state) or per block (entries/index)
    width: int       # values per row
    dtype: torch.dtype
    per: str         # "slot" | "block"


def storage_plan(cfg, block_size: int, dtype: torch.dtype, extra_ring_rows: int = 0) -> list[StorageItem]:
    items = []
    d = cfg.head_dim
    swa_rows = cfg.sliding_window + extra_ring_rows
    for layer in range(cfg.num_layers):
        items.append(StorageItem("swa", layer, swa_rows, d, dtype, "slot"))
        spec = compressor_spec(cfg, layer)
        if spec is None:
            continue
        m, ring, overlap = spec
        mult = 2 if overlap else 1
        state_dtype = torch.float32 if cfg.is_v41 else dtype
        ring += extra_ring_rows
        items.append(StorageItem("state_main", layer, ring, 2 * mult * d, state_dtype, "slot"))
        items.append(StorageItem("entries", layer, block_size // m, d, dtype, "block"))
        owns_index = (cfg.index_k_source_map[layer] == layer) if cfg.is_v41 else cfg.layer_kinds[layer] == "csa"
        if owns_index:
            items.append(StorageItem("index", layer, block_size // m, cfg.index_head_dim, dtype, "block"))
            if not cfg.is_v41:
                items.append(StorageItem("state_index", layer, ring, 2 * 2 * cfg.index_head_dim, dtype, "slot"))
    if cfg.is_v41:
        for i in range(cfg.num_nextn_predict_layers):
            items.append(StorageItem("swa", cfg.num_layers + i, swa_rows, d, dtype, "slot"))
    return items


def snapshot_plan(cfg, block_size: int, dtype: torch.dtype) -> list[StorageItem]:
    """The prefix cache's per-block snapshot stores (model_executor/prefix_state.py): one per SWA ring
    (kind "swa_snap") and per overlapping compressor's state ring ("state_snap")."""
    items = []
    for it in storage_plan(cfg, block_size, dtype):
        if it.kind == "swa":
            items.append(StorageItem("swa_snap", it.layer, swa_snapshot_rows(cfg.sliding_window, block_size),
                                     it.width, it.dtype, "block"))
        elif it.kind in ("state_main", "state_index"):
            rows = comp_snapshot_rows(compressor_spec(cfg, it.layer))
            if rows:
                items.append(StorageItem("state_snap_" + it.kind.split("_")[1], it.layer, rows, it.width,
                                         it.dtype, "block"))
    return items


def cache_formats(cfg, mode: str, dtype: torch.dtype, fp8_max: float = quant.FP8_E4M3_MAX) -> CacheFormats:
    return CacheFormats(swa=record_format("swa", cfg.head_dim, mode, dtype, fp8_max),
                        entries=record_format("entries", cfg.head_dim, mode, dtype, fp8_max),
                        index=record_format("index", cfg.index_head_dim, mode, dtype, fp8_max))


def allocate_cache(cfg, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device="cpu", mode: str = "plain", fp8_max: float = quant.FP8_E4M3_MAX,
                   extra_ring_rows: int = 0, prefix_snapshots: bool = False) -> ModelCache:
    """mode "plain" stores values in `dtype`; "compact" stores DeepSeek's byte records
    (worker/kv_records.py) whose e4m3 bytes stay within `fp8_max` (the platform's).
    Compressor state rings are never compacted. prefix_snapshots: also the prefix cache's per-block
    snapshot stores (snapshot_plan), in the same record formats as the rings they copy."""
    fmts = cache_formats(cfg, mode, dtype, fp8_max)
    cache = ModelCache(formats=fmts)
    for it in storage_plan(cfg, block_size, dtype, extra_ring_rows):
        n = it.rows_per * (num_slots if it.per == "slot" else num_blocks)
        if it.kind in ("swa", "entries", "index"):
            buf = getattr(fmts, "swa" if it.kind == "swa" else it.kind).alloc(n, device)
        else:
            buf = torch.zeros(n, it.width, dtype=it.dtype, device=device)
        if it.kind == "swa":
            cache.swa[it.layer] = buf
        elif it.kind == "state_main":
            cache.comp_state[(it.layer, "main")] = buf
        elif it.kind == "state_index":
            cache.comp_state[(it.layer, "index")] = buf
        elif it.kind == "entries":
            cache.entries[it.layer] = buf
        else:
            cache.index_keys[it.layer] = buf
    for it in snapshot_plan(cfg, block_size, dtype) if prefix_snapshots else ():
        n = it.rows_per * num_blocks
        if it.kind == "swa_snap":
            cache.swa_snap[it.layer] = fmts.swa.alloc(n, device)
            continue
        key = (it.layer, it.kind.removeprefix("state_snap_"))
        cache.state_snap[key] = torch.zeros(n, it.width, dtype=it.dtype, device=device)
        cache.state_snap_spec[key] = compressor_spec(cfg, it.layer)
    return cache


def bytes_per_block(cfg, block_size: int, dtype: torch.dtype, mode: str = "plain",
                    prefix_snapshots: bool = False) -> int:
    items = [it for it in storage_plan(cfg, block_size, dtype) if it.per == "block"]
    if prefix_snapshots:
        items += snapshot_plan(cfg, block_size, dtype)
    return sum(it.rows_per * record_bytes(_record_kind(it.kind), it.width, mode, dtype) for it in items)


def _record_kind(kind: str) -> str:
    return {"swa_snap": "swa"}.get(kind, "state" if kind.startswith("state") else kind)


def bytes_per_slot(cfg, dtype: torch.dtype) -> int:
    return sum(it.rows_per * it.width * torch.finfo(it.dtype).bits // 8
               for it in storage_plan(cfg, default_block_size(cfg), dtype) if it.per == "slot")


# ---- bytes-per-token report (no allocation) ----------------------------------------------------
# Compact record sizes follow DeepSeek's engine formats (docs/model.md §5.1): SWA kv as 512 e4m3 + one
# ue8m0 scale per 32 values; compressed main KV as e2m1 with one e4m3 scale per 16 values; index
# keys as e2m1 with one ue8m0 scale per 32; compressor state rows stay fp32.
def record_bytes(kind: str, width: int, mode: str, dtype: torch.dtype) -> int:
    if mode == "plain":
        return width * torch.finfo(dtype).bits // 8
    if mode != "compact":
        raise ValueError(f"mode: expected 'plain' or 'compact', got {mode!r}")
    if kind in ("swa", "entries", "index"):
        return record_format(kind, width, mode, dtype).record_bytes()
    return width * 4  # compressor state: fp32


def kv_cache_report(cfg, mode: str = "plain", dtype: torch.dtype = torch.bfloat16, max_q: int = 1) -> dict:
    """Bytes per token of growth (compressed entries and index keys) and fixed bytes per sequence
    (SWA rings of every layer incl. draft layers, compressor state rings sized ratio + max_q - 1)."""
    per_token = 0.0
    per_seq = 0
    detail = {"entries": 0.0, "index": 0.0, "swa": 0, "state": 0}
    block = default_block_size(cfg)
    for it in storage_plan(cfg, block, dtype):
        if it.per == "block":
            m = block // it.rows_per
            b = record_bytes(it.kind, it.width, mode, dtype) / m
            per_token += b
            detail[it.kind] += b
        elif it.kind == "swa":
            b = it.rows_per * record_bytes("swa", it.width, mode, dtype)
            per_seq += b
            detail["swa"] += b
        else:
            ring = it.rows_per
            spec = compressor_spec(cfg, it.layer)
            if cfg.is_v41 and spec is not None:
                ring = spec[0] + max_q - 1 if spec[0] > 1 else 0  # C1 keeps no state
            b = ring * it.width * torch.finfo(it.dtype).bits // 8  # state rows are never compacted
            per_seq += b
            detail["state"] += b
    return {"mode": mode, "dtype": str(dtype).replace("torch.", ""), "bytes_per_token": per_token,
            "bytes_per_sequence_fixed": per_seq, "detail": detail}
