"""The largest intermediate tensor of a graph, measured on meta tensors (docs/neuron.md §4 B7).

A graph's intermediates must fit the core's HBM next to the weights and the KV cache; the seed's
per-row gathers of a prompt chunk made [128, 8192, 512] intermediates that did not. `IntermediateRecorder`
is a TorchDispatchMode that records the bytes of every op output that is not (a view of) one of the
op's inputs: each tensor a compiled graph would allocate. Run on meta tensors it measures full-scale
shapes without allocating them.

`step_region_intermediates` runs one fixed-shape step (model_executor/static_step.py) of a model on
meta and records each decoder layer's regions apart, as the Neuron runner compiles them
(neuron_ops/regions.py SUB_REGIONS: projections = `DecoderLayer.attn_in`, attention = `attn_out`,
ffn = `ffn_half`), plus the eager top level around them. `prompt_chunk_intermediates` does that for
the last `tokens`-token chunk of a `context`-token prompt of a config (tools/dry_run.py builds the
rank's model and cache on meta):

    python -m deepinfer.tools.intermediates --config examples/configs/v41-flash.json \
        [--context 16384] [--tokens 2048] [--cp 64 --ep 64] [--regions projections,attention] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MiB = 1 << 20


@dataclass(frozen=True)
class Intermediate:
    bytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # tensor subclasses without a plain storage
        return None


class IntermediateRecorder(TorchDispatchMode):
    """Records the largest op output that does not alias an input (views, in-place results and
    `out=` writes are not new tensors)."""

    def __init__(self):
        super().__init__()
        self.largest: Intermediate | None = None
        self.by_op: dict[str, Intermediate] = {}   # the largest output of each op name
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.num_ops += 1
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or _storage_key(t) in inputs:
                continue
            n = t.numel() * t.element_size()
            if self.largest is None or n > self.largest.bytes:
                self.largest = Intermediate(n, str(func), tuple(t.shape), str(t.dtype).removeprefix("torch."))
            if str(func) not in self.by_op or n > self.by_op[str(func)].bytes:
                self.by_op[str(func)] = Intermediate(n, str(func), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return out

    @property
    def max_bytes(self) -> int:
        return 0 if self.largest is None else self.largest.bytes


def largest_intermediate(fn, *args, **kwargs) -> tuple[object, Intermediate | None]:
    """(fn's result, the largest intermediate it made): fn run under an IntermediateRecorder."""
    with IntermediateRecorder() as rec:
        out = fn(*args, **kwargs)
    return out, rec.largest


def max_intermediate_bytes(fn, *args, **kwargs) -> int:
    """Bytes of the largest tensor fn's ops create (0 when none): a traced graph's largest intermediate."""
    _, big = largest_intermediate(fn, *args, **kwargs)
    return 0 if big is None else big.bytes


GATHER_OPS = ("aten.index.Tensor", "aten.gather.default")   # the ops a per-row gather runs as
REGIONS = ("projections", "attention", "ffn")   # neuron_ops/regions.py SUB_REGIONS, in layer order


def step_region_intermediates(model, cache, layout, chunks, bucket, regions=REGIONS) -> dict:
    """One fixed-shape step of `chunks` padded to `bucket` (on the model's device, meta for full
    scale): {"tokens", "context", "regions": [{"layer", "kind", "region", **Intermediate}], "step":
    the whole step's largest}. Without "ffn" in `regions` the MoE half is skipped (its output has the
    trunk's shape, so the attention regions of later layers see the shapes they would)."""
    from deepinfer.model_executor.forward_meta import step_to
    from deepinfer.model_executor.static_step import BucketSpec
    from deepinfer.neuron_ops.regions import layer_kind
    spec = BucketSpec(batch=(bucket.num_seqs,), contexts=(bucket.context,), prefill_tokens=(bucket.num_tokens,),
                      max_model_len=bucket.context)
    device = next(model.parameters()).device
    # the host stage first (the Engram rows, layers/engram_host.py), as every runner's to_device does
    step = step_to(model.host_inputs(spec.static_step(chunks, bucket, layout)), device)
    rows: list[dict] = []
    kinds: list = []

    def record(layer, region, fn, *args):
        out, big = largest_intermediate(fn, *args)
        key = layer_kind(layer)
        if key not in kinds:
            kinds.append(key)
        rows.append({"layer": layer.layer, "kind": kinds.index(key), "region": region,
                     **asdict(big or Intermediate(0, "", (), ""))})
        return out

    def run_layer(layer, x, prev_pre, ctx, io):
        mid = record(layer, "projections", layer.attn_in, x, prev_pre, ctx, io)
        x, pre = record(layer, "attention", layer.attn_out, *mid, ctx, io)
        return record(layer, "ffn", layer.ffn_half, x, pre, ctx) if "ffn" in regions else (x, pre)

    # the top level (embedding, final norm, LM head) runs outside run_layer; the layers' own
    # recorders nest inside this one, so its maximum covers the whole step
    with IntermediateRecorder() as whole:
        model(step, cache, run_layer=run_layer)
    ops = sorted(whole.by_op.values(), key=lambda i: -i.bytes)
    return {"tokens": bucket.num_tokens, "context": bucket.context, "regions": rows,
            "step": asdict(whole.largest), "ops": [asdict(i) for i in ops]}


def largest_by_region(report: dict) -> dict[str, dict]:
    """The largest intermediate of each region name over every layer of a step report."""
    out: dict[str, dict] = {}
    for row in report["regions"]:
        if row["region"] not in out or row["bytes"] > out[row["region"]]["bytes"]:
            out[row["region"]] = row
    return out


def prompt_chunk_intermediates(cfg, context: int = 16384, tokens: int = 2048, cp: int = 1, ep: int = 1,
                               rank: int = 0, dtype=torch.bfloat16, regions=REGIONS) -> dict:
    """step_region_intermediates of the last `tokens`-token chunk of a `context`-token prompt on
    rank `rank` of a cp x ep layout, the model and its cache on meta (tools/dry_run.py)."""
    from deepinfer.distributed.groups import ParallelGroups
    from deepinfer.distributed.parallel_layout import ParallelLayout
    from deepinfer.model_executor.static_step import Bucket
    from deepinfer.tools import dry_run as dr
    world = max(cp, ep)
    layout = ParallelLayout(rank, cp, ep, min(cp, 8), 1)
    with dr.fake_world(rank, world):
        model = dr.build_rank_model(cfg, ParallelGroups.create(layout), dtype)
        cache, cache_layout, bs = dr.dry_run_cache(cfg, 1, context, dtype, "plain", model.engram_spec)
        report = step_region_intermediates(model, cache, cache_layout, dr.prefill_chunks(tokens, context, bs),
                                           Bucket(1, tokens, context), regions)
    return {"cp": cp, "ep": ep, "rank": rank, **report}


def format_report(report: dict) -> str:
    lines = [f"prompt chunk of {report['tokens']} tokens at context {report['context']} "
             f"(cp {report['cp']}, ep {report['ep']}, rank {report['rank']}): largest intermediate per region"]
    for region, row in largest_by_region(report).items():
        lines.append(f"  {region:12s} {row['bytes'] / MiB:10.1f} MiB  layer {row['layer']:3d}  {row['op']} "
                     f"{list(row['shape'])} {row['dtype']}")
    s = report["step"]
    lines.append(f"  {'whole step':12s} {s['bytes'] / MiB:10.1f} MiB  {s['op']} {list(s['shape'])} {s['dtype']}")
    # the gathers (advanced indexing, gather) the B7 rule is about, whatever their rank among the ops
    for row in report["ops"]:
        if row["op"] in GATHER_OPS:
            lines.append(f"  {'gather':12s} {row['bytes'] / MiB:10.1f} MiB  {row['op']} {list(row['shape'])} {row['dtype']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from deepinfer.config import ModelConfig
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a checkpoint directory's config.json")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--regions", default=",".join(REGIONS), help="comma-separated subset of " + ",".join(REGIONS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    report = prompt_chunk_intermediates(cfg, args.context, args.tokens, args.cp, args.ep,
                                        regions=tuple(args.regions.split(",")))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
