"""Bytes one prompt chunk gathers from the compressed caches (index keys, entry records), measured on
meta at a config's full shapes (docs/neuron.md §4 B7): the indexer reading the chunk's shared scope
(eager and compiled steps alike) against the indexer gathering every row's own keys (what compiled
regions did before they took the scope); the attention reads the scope in both.

On meta a chunk's `row_chunks.scope_branch` runs both branches (a graph holds both); here it runs
the one the chunk takes (all its rows are the scope sequence's: `tools/dry_run.prefill_chunks` is
one sequence), or the per-row branch for the indexer when asked (the indexer gathers the scope
before it branches, so the per-row figure holds the scope's gather too):

    python -m deepinfer.tools.scope_gathers --config examples/configs/v41-flash.json \
        [--context 16384] [--tokens 2048]
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MiB = 1 << 20
STORES = ("index_keys", "entries")


class CacheGathers(TorchDispatchMode):
    """Bytes and largest output of the advanced-indexing reads of the given cache tensors, per store."""

    def __init__(self, stores: dict[str, list[torch.Tensor]]):
        super().__init__()
        self.store_of = {t.untyped_storage()._cdata: name for name, ts in stores.items() for t in ts}
        self.bytes = dict.fromkeys(stores, 0)
        self.largest = dict.fromkeys(stores, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index.Tensor:
            name = self.store_of.get(args[0].untyped_storage()._cdata)
            if name is not None:
                n = out.numel() * out.element_size()
                self.bytes[name] += n
                self.largest[name] = max(self.largest[name], n)
        return out


@contextlib.contextmanager
def branches(indexer_per_row: bool):
    """scope_branch as the chunk takes it (shared), the indexer's per row when `indexer_per_row`."""
    from deepinfer.model_executor.models import v4_attention
    real = v4_attention.scope_branch

    def pick(in_scope, shared, own, args, part=""):
        return own(*args) if indexer_per_row and part == "indexer" else shared(*args)
    v4_attention.scope_branch = pick
    try:
        yield
    finally:
        v4_attention.scope_branch = real


def chunk_gathers(cfg, context: int = 16384, tokens: int = 2048, indexer_per_row: bool = False,
                  dtype=torch.bfloat16) -> dict:
    """{"bytes": {store: bytes}, "largest": {store: bytes}} the last `tokens`-token chunk of a
    `context`-token prompt gathers from the compressed caches, one rank of cp 1 / ep 1 on meta."""
    from deepinfer.distributed.groups import ParallelGroups
    from deepinfer.distributed.parallel_layout import ParallelLayout
    from deepinfer.model_executor.forward_meta import step_to
    from deepinfer.model_executor.static_step import Bucket, BucketSpec
    from deepinfer.tools import dry_run as dr
    model = dr.build_rank_model(cfg, ParallelGroups.create(ParallelLayout(0, 1, 1, 1, 1)), dtype)
    cache, layout, bs = dr.dry_run_cache(cfg, 1, context, dtype, "plain", model.engram_spec)
    bucket = Bucket(1, tokens, context)
    spec = BucketSpec(batch=(1,), contexts=(context,), prefill_tokens=(tokens,), max_model_len=context)
    step = step_to(model.host_inputs(spec.static_step(dr.prefill_chunks(tokens, context, bs), bucket, layout)),
                   next(model.parameters()).device)
    stores = {"index_keys": list(cache.index_keys.values()), "entries": list(cache.entries.values())}

    def skip_ffn(layer, x, prev_pre, ctx, io):   # the MoE half gathers no compressed cache
        return layer.attn_half(x, prev_pre, ctx, io)
    with branches(indexer_per_row), CacheGathers(stores) as rec:
        model(step, cache, run_layer=skip_ffn)
    return {"bytes": rec.bytes, "largest": rec.largest}


def main(argv=None) -> int:
    from deepinfer.config import ModelConfig
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a checkpoint directory's config.json")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    print(f"compressed-cache gathers of a {args.tokens}-token chunk at context {args.context} (all layers)")
    for label, per_row in (("indexer per row", True), ("shared scope", False)):
        r = chunk_gathers(cfg, args.context, args.tokens, per_row)
        cells = "  ".join(f"{s} {r['bytes'][s] / MiB:10.1f} MiB (largest {r['largest'][s] / MiB:.1f})" for s in STORES)
        print(f"  {label:16s} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
