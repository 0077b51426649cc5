"""The graphs a Neuron engine compiles, counted before it compiles any (docs/neuron.md §4 B8, §5.10).

A region graph is one (region, layer kind, token count, context bucket): the buckets come from the
BucketSpec (what warm-up walks), the regions of a bucket from the split policy (neuron_ops/regions.py
`regions_of_step`), the layer kinds from the model's layers, or from the config alone
(`config_layer_kinds`, no model build), so the count of a full-size config is a test, not a run.
The model's top level adds, per bucket, an "entry" graph (its inputs' sizes depend on the tokens and
the context) and an "exit" graph (tokens and the fixed logits rows only), and with speculative
decoding a "draft" graph per row bucket (rows x B tokens padded to a power of two; a draft block's
window attention reads no context table; the same graph serves host-sampled and argmax drafts),
and a "verify_draft" graph per verification row bucket (a greedy step's acceptance over that bucket's
exit logits rows, then the next draft block of its rows: spec/greedy_step.py); their `kind` is TOP_KIND.
Under the cpu platform's "step" compile scope a bucket is one "step" graph instead of its entry, layer
and exit graphs (neuron_ops/regions.py COMPILE_SCOPES).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from deepinfer.model_executor.static_step import Bucket, BucketSpec, draft_block_tokens
from deepinfer.neuron_ops.regions import checked_scope, kind_key, regions_of_step

TOP_KIND = -1   # PlannedGraph.kind of the top-level regions (regions.TOP_REGIONS)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedGraph:
    region: str     # regions.WHOLE, regions.SUB_REGIONS or regions.TOP_REGIONS name
    kind: int       # index into CompilePlan.kinds (TOP_KIND for the top level)
    step: str       # decode | verify | prefill | draft
    tokens: int
    context: int


@dataclass(frozen=True)
class CompilePlan:
    graphs: tuple[PlannedGraph, ...]
    kinds: tuple[tuple, ...]          # layer_kind keys, in order of first layer
    layers_per_kind: tuple[int, ...]
    split: str

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    spec: BucketSpec | None = None

    def step_of(self, bucket: Bucket) -> str:
        return step_class(bucket, self.spec)

    def counts(self, field: str) -> dict:
        """Graphs per value of one PlannedGraph field (region, step, tokens, context), sorted."""
        return dict(sorted(Counter(getattr(g, field) for g in self.graphs).items()))

    def buckets(self) -> list[dict]:
        """One row per (step, tokens, context): its regions and graphs."""
        rows: dict[tuple, dict] = {}
        for g in self.graphs:
            row = rows.setdefault((g.step, g.tokens, g.context), {
                "step": g.step, "tokens": g.tokens, "context": g.context, "regions": [], "graphs": 0})
            if g.region not in row["regions"]:
                row["regions"].append(g.region)
            row["graphs"] += 1
        return list(rows.values())

    def to_dict(self) -> dict:
        return {"graph_count": self.graph_count, "split": self.split, "layer_kinds": len(self.kinds),
                "layers_per_kind": list(self.layers_per_kind), "by_step": self.counts("step"),
                "by_region": self.counts("region"), "buckets": self.buckets()}

    def describe(self) -> str:
        """The plan in one log line."""
        buckets = ", ".join(f"{b['step']} {b['tokens']}x{b['context']} ({'+'.join(b['regions'])})"
                            for b in self.buckets())
        steps = ", ".join(f"{n} {s}" for s, n in self.counts("step").items())
        return (f"{self.graph_count} region graphs to compile ({steps}): {len(self.kinds)} layer kinds x "
                f"buckets [{buckets}], split policy {self.split}")


def step_class(bucket: Bucket, spec: BucketSpec) -> str:
    if bucket.num_tokens == bucket.num_seqs:
        return "decode"
    verify = {spec.verify_bucket_tokens(rows) for rows in spec.verify_batch} if spec.verify_tokens > 1 else set()
    # a token count that is both a verification and a prompt bucket is one set of graphs: the first
    # bucket all_buckets walks names it
    if bucket.num_tokens in verify and bucket.num_tokens not in (spec.prefill_tokens or ()):
        return "verify"
    return "prefill"


def exit_logits_rows(bucket: Bucket, spec: BucketSpec) -> int:
    """The fixed logits rows of a bucket's compiled exit: every token of a decode or verification
    bucket; in a prompt bucket one a sequence (each with its verification rows), not every prompt
    token (a 2048-row LM head would be computed for the few rows sampled). A step wanting more (prompt
    logprobs) runs its exit eagerly."""
    if step_class(bucket, spec) != "prefill":
        return bucket.num_tokens
    return min(bucket.num_tokens, max(spec.batch) * max(1, spec.verify_tokens))


def greedy_spec_rows(bucket: Bucket, spec: BucketSpec, rows: int) -> int | None:
    """The block rows of a greedy speculative step of `rows` sampling rows in `bucket`
    (spec/greedy_step.py): the smallest verification row bucket that holds them, when `bucket` has
    that row bucket's verification token count (the plan's `verify_draft` graph reads its exit's
    logits rows); else None (the host verifies)."""
    if spec.verify_tokens <= 1:
        return None
    r = next((b for b in spec.verify_batch if b >= rows), None)
    return None if r is None or bucket.num_tokens != spec.verify_bucket_tokens(r) else r


def compile_plan(spec: BucketSpec, layer_kinds: list[tuple], split: str, drafts: int = 0,
                 scope: str = "layer") -> CompilePlan:
    """Every region graph warm-up compiles for these buckets, layer kinds (one per decoder layer, in
    layer order), split policy, draft block length (0: no speculative decoding) and compile scope
    (regions.COMPILE_SCOPES: "step" compiles each bucket as one "step" graph, layers unrolled). Graphs
    are unique per (region, kind, tokens, context): two buckets of one shape share their graphs, as
    Dynamo shares them."""
    checked_scope(scope)
    kinds: list[tuple] = []
    for key in layer_kinds:
        if key not in kinds:
            kinds.append(key)
    per_kind = Counter(kinds.index(k) for k in layer_kinds)
    seen: dict[tuple, PlannedGraph] = {}
    for bucket in spec.all_buckets():
        step = step_class(bucket, spec)
        t, c = bucket.num_tokens, bucket.context
        if scope == "step":
            seen.setdefault(("step", TOP_KIND, t, c), PlannedGraph("step", TOP_KIND, step, t, c))
            continue
        seen.setdefault(("entry", TOP_KIND, t, c), PlannedGraph("entry", TOP_KIND, step, t, c))
        for region in regions_of_step(split, bucket.num_seqs, t, prompt=step == "prefill"):
            for k in range(len(kinds)):
                seen.setdefault((region, k, t, c), PlannedGraph(region, k, step, t, c))
        rows = exit_logits_rows(bucket, spec)
        seen.setdefault(("exit", TOP_KIND, t, rows), PlannedGraph("exit", TOP_KIND, step, t, c))
    for rows in spec.batch if drafts else ():
        t = draft_block_tokens(rows, drafts)
        seen.setdefault(("draft", TOP_KIND, t), PlannedGraph("draft", TOP_KIND, "draft", t, 0))
    # a greedy verification step's acceptance and next draft block (spec/greedy_step.py): one graph a
    # verification row bucket, over its exit's logits rows and the block of its rows
    for rows in spec.verify_batch if drafts and spec.verify_tokens > 1 else ():
        t = spec.verify_bucket_tokens(rows)
        seen.setdefault(("verify_draft", TOP_KIND, t, rows),
                        PlannedGraph("verify_draft", TOP_KIND, "draft", draft_block_tokens(rows, drafts), 0))
    return CompilePlan(tuple(seen.values()), tuple(kinds), tuple(per_kind[k] for k in range(len(kinds))), split,
                       spec)


def config_layer_kinds(cfg) -> list[tuple]:
    """The layer_kind of every decoder layer of a ModelConfig without building the model: each layer's
    Attention on the meta device (no expert, no table) and its layer_facts; tests check the result
    equals the built model's kinds."""
    from deepinfer.model_executor.models.deepseek_v4 import layer_facts, make_engram_spec
    from deepinfer.model_executor.models.v4_attention import Attention
    engram = make_engram_spec(cfg)
    out = []
    with torch.device("meta"):
        for i in range(cfg.num_layers):
            shape = None
            if engram is not None and i in engram.layers:
                shape = (engram.layer(i).num_rows, cfg.engram_head_dim)   # Engram.embed.weight
            out.append(kind_key("DecoderLayer", Attention(cfg, i, torch.bfloat16), layer_facts(cfg, i), shape))
    return out
