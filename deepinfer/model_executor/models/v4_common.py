"""Building blocks the V4 / V4.1 decoder's modules share: parameter helpers, the per-layer caches
(`ModelCache`, `CacheFormats`), the per-forward `StepContext` and the per-layer `LayerIO`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.model_executor.forward_meta import StepInputs
from deepinfer.model_executor.layers.engram_host import layer_rows


def linear(i: int, o: int, dtype) -> nn.Linear:
    return nn.Linear(i, o, bias=False, dtype=dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))


def f32_param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


@dataclass
class ModelCache:
    """Storage the forward reads and writes; allocated by worker/cache_engine.py."""
    swa: dict = field(default_factory=dict)         # layer -> [slots * W, d]
    comp_state: dict = field(default_factory=dict)  # (layer, "main"|"index") -> [slots * ring, 2 * width]
    entries: dict = field(default_factory=dict)     # kv-source layer -> [blocks * epb, d]
    index_keys: dict = field(default_factory=dict)  # index-K source layer -> [blocks * epb, index_head_dim]
    formats: "CacheFormats" = None                 # encode/decode of swa, entries and index records
    # Prefix caching (model_executor/prefix_state.py): per-block copies of the slot state at the block's end.
    swa_snap: dict = field(default_factory=dict)    # layer -> [blocks * min(W, block_size), record]
    state_snap: dict = field(default_factory=dict)  # (layer, "main"|"index") -> [blocks * ratio, 2 * width]
    state_snap_spec: dict = field(default_factory=dict)  # same keys -> the compressor's (ratio, ring, overlap)


@dataclass(frozen=True)
class CacheFormats:
    swa: object
    entries: object
    index: object


class StepContext:
    """Per-forward values shared across layers: RoPE tables, top-k reuse, YOCO shared hidden.

    Everything position- or layer-dependent is computed here, before the layer loop (RoPE tables, in
    the step's compiled entry region under Neuron regions; the Engram rows come gathered with the step),
    so layer code only reads it: compiled layer regions then see the same
    Python state for every layer of a kind (docs/neuron.md §4 F1).

    Slots, as LayerIO's (below): a whole step compiled as one graph (the cpu platform's "step" scope)
    builds this object and writes `candidates` / `shared_hidden` inside the trace, after the torch.cond
    of an earlier layer; with an instance __dict__ Dynamo lost those writes (the YOCO consumer read
    None)."""

    __slots__ = ("step", "cache", "model", "k", "_rope", "_entry_rope", "engram_rows", "topk", "candidates",
                 "shared_hidden", "targets")

    def __init__(self, model: nn.Module, step: StepInputs, cache: ModelCache, tables=None):
        """model: the DeepseekV4Model running the step (not imported here: that module imports this one);
        tables: the step's `rope_tables` when a compiled entry region computed them already."""
        self.step = step
        self.cache = cache
        self.model = model
        self.k = model.kernels
        self._rope, self._entry_rope = tables if tables is not None else rope_tables(model, step)
        # Engram rows arrive gathered: the int64 hash and the table fetch ran on the host before the
        # step was copied in (layers/engram_host.py; docs/neuron.md §4 A4/A5, §5.9)
        self.engram_rows: dict[int, torch.Tensor] = layer_rows(model, step)
        self.topk: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.shared_hidden: torch.Tensor | None = None
        self.targets: dict[int, torch.Tensor] = {}

    def rope(self, kind: str):
        """cos/sin of the step's token positions for "main" or "compress"."""
        return self._rope[kind]

    def entry_rope(self, comp_key):
        """cos/sin (compress) of the positions of the entries a compressor writes this step."""
        return self._entry_rope[comp_key]


def rope_tables(model: nn.Module, step: StepInputs) -> tuple[dict, dict]:
    """cos/sin of the step's token positions per rotary kind, and of each compressor's new entries."""
    rope = {kind: rot.cos_sin(step.positions) for kind, rot in model.rotary.items()}
    entry = {key: model.rotary["compress"].cos_sin(meta.entry_pos) for key, meta in step.comp.items()}
    return rope, entry


@dataclass(slots=True)
class LayerIO:
    """One layer's cache tensors and cross-layer inputs, resolved by the eager layer loop
    (`DecoderLayer.layer_io`), so layer code never indexes anything by its layer id and one compiled
    region serves every layer of a kind. Values a layer hands to later layers go to the `*_out`
    fields and are stored back by `DecoderLayer.collect`.

    Slots, not an instance __dict__: a region graph writes `*_out` fields on both sides of a
    torch.cond (row_chunks.scope_branch), and Dynamo (torch 2.13) tracks __dict__ writes through a
    tracker that keeps the side-effect table of the object's first write, which the cond's branch
    tracing replaces; later writes then went to the discarded table and were lost (a target layer's
    `target_out` before the indexer's cond, its `topk_out` after). Slot writes go to the current
    table (tests/unit/test_layer_io_cond.py)."""
    swa: torch.Tensor                           # SWA ring (written)
    fmt: "CacheFormats"                         # record formats of the stores (plain or compact)
    state: torch.Tensor | None = None           # own compressor state ring (read + written)
    index_state: torch.Tensor | None = None     # own V4 indexer-compressor state ring
    swa_snap: torch.Tensor | None = None        # prefix-cache snapshot stores of the rings above
    state_snap: torch.Tensor | None = None
    index_state_snap: torch.Tensor | None = None
    entries: torch.Tensor | None = None         # entry pool attention reads (written by its owner)
    index_keys: torch.Tensor | None = None      # index-key pool the indexer reads (written by its owner)
    topk: torch.Tensor | None = None            # selection reused from the index source layer
    candidates: torch.Tensor | None = None      # V4.1 candidate blocks of the candidate source layer
    shared_hidden: torch.Tensor | None = None   # V4.1 YOCO hidden of n_prefill_layer
    engram_rows: torch.Tensor | None = None     # this layer's Engram table rows, gathered on the host [T, K * d]
    topk_out: torch.Tensor | None = None
    candidates_out: torch.Tensor | None = None
    shared_hidden_out: torch.Tensor | None = None
    target_out: torch.Tensor | None = None
