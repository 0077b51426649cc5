"""Full-scale dry run: every rank's shard of the model on meta tensors under a fake process group.

`dry_run(cfg, cp, ep, ...)` walks the ranks of a ParallelLayout. For each rank it joins a fake world
(torch's `fake` backend with a FakeStore: every collective returns at once, on meta tensors too),
builds the ParallelGroups and the rank's model as the engine builds it (packed weights, post_load) on
the meta device, and counts its bytes:

- weights_bytes: every parameter and buffer the rank holds (memory_report.resident_bytes), less the
  Engram tables;
- engram_bytes: the Engram tables as this rank's share of its host's one shared copy
  (distributed/shared_tables.py): table bytes / ranks per host (the full tables for a rank alone on
  its host). They live in host memory, not in the core's HBM: engram_hbm_bytes, the table bytes
  among the tensors `model.to(device)` would move (layers/engram_host.py), is 0;
- kv_bytes: the KV cache the dry run's steps need (batch rows + the scratch slot, one block table
  of `context` tokens per row + the scratch block), allocated on meta (worker/cache_engine.py).

Ranks whose models hold the same tensors (names, shapes, dtypes) and the same place in their groups
run the same step; for each such class the dry run then runs one decode step (`batch` rows at
`context`) and one prompt chunk (`prefill_tokens` tokens, the last chunk of a `context`-token
prompt) through the fixed-shape path the Neuron graphs run (static_step.BucketSpec.static_step:
placeholder rows, static sizes, no host syncs), recording every collective (comm.record_collectives,
per decoder layer through the forward's run_layer hook) and the bytes the step reads (ReadCounter).

With `nextn = B > 0` (speculative decoding, docs/model.md §3.8) each class also runs the
verification step (`batch` rows of 1 + B tokens: the main forward also writes the draft layers' main
keys) and one DSpark draft block (`batch` rows of B tokens through the draft layers), and the report
gives the tokens per step a speculative step must emit to beat a plain decode step at the estimated
floors (`speculative_estimate`).

`floor_estimate` turns a step into a labelled ESTIMATE of its lower bound on trn2 (HBM bytes /
bandwidth per rank, collectives at a stated latency); nothing here ran on a device.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deepinfer.distributed import comm
from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.model_executor.checkpoint_schema import no_weight_init
from deepinfer.tools import memory_report as mr

# trn2 figures the estimate uses (docs/neuron.md §1.1, §1.3, §6.2); none measured here.
TRN2_HBM_BYTES_PER_S_PER_RANK = 0.7e12     # §1.1: 2.9 TB/s per chip / 4 logical cores at LNC = 2
COLLECTIVE_LATENCY_HW_S = 10e-6            # §1.3: documented collective latency, 1-10 µs (upper end)
SEED_LATENCY_S = {8: 0.1e-3, 64: 1.9e-3}   # §6.2: the seed's measured [1, 5120] all-reduce, low ends
FLOOR_SOURCES = ("HBM bandwidth per rank: docs/neuron.md §1.1; documented collective latency: docs/neuron.md "
                 "§1.3; the seed's measured collective latency: docs/neuron.md §6.2")


# ---------------------------------------------------------------------------------------------
# fake world and rank models
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """torch.distributed as rank `rank` of `world_size`, with the fake backend (no peers, no data)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if world_size == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_takes_parallel() -> bool:
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    return "parallel" in inspect.signature(DeepseekV4Model.__init__).parameters


def build_rank_model(cfg, groups: ParallelGroups, dtype=torch.bfloat16, platform=None):
    """The rank's model as build_model makes it (packed weights, then post_load), on meta."""
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    kw = {}
    if groups.layout.world_size > 1:
        if not model_takes_parallel():
            raise NotImplementedError("DeepseekV4Model takes no parallel=: this tree has no sharded model")
        kw["parallel"] = groups
    with torch.device("meta"), no_weight_init():
        model = DeepseekV4Model(cfg, dtype, platform=platform, **kw)
        model.use_weight_formats(mr.config_weight_formats(cfg))
        model.post_load()
    return model


def shard_signature(model, layout: ParallelLayout) -> tuple:
    """What decides a rank's step: its tensors (names, shapes, dtypes) and the sizes of its groups (the
    model code never branches on a rank's index, only on what it holds and whom it talks to)."""
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in mr.model_tensors(model).items())
    return (tensors, layout.cp, layout.attn_tp, layout.ep, layout.tokens_replicated_in_ep)


# ---------------------------------------------------------------------------------------------
# the steps
# ---------------------------------------------------------------------------------------------


def dry_run_cache(cfg, batch: int, context: int, dtype=torch.bfloat16, mode: str = "plain", engram_spec=None,
                  nextn: int = 0, slots: int | None = None):
    """(cache on meta, CacheLayout, block size): `batch` rows of `context` tokens plus the scratch slot
    and block, as the worker sizes a pool for them (rings grown for `nextn` drafts' rollback). slots:
    state slots (each with its SWA and compressor rings) when the pool has more than the rows need, as
    a serving config's max_num_seqs + 1 (default batch + 1)."""
    from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size, speculative_ring_rows
    bs, extra = default_block_size(cfg), speculative_ring_rows(nextn)
    slots, blocks = max(batch + 1, slots or 0), batch * -(-context // bs) + 1
    cache = allocate_cache(cfg, slots, blocks, bs, dtype, device="meta", mode=mode, extra_ring_rows=extra)
    return cache, cache_layout(cfg, slots, bs, engram_spec, extra_ring_rows=extra), bs


def cache_bytes(cache) -> int:
    seen, total = set(), 0
    for group in (cache.swa, cache.comp_state, cache.entries, cache.index_keys):
        for t in group.values():
            for leaf in (t if isinstance(t, (tuple, list)) else (t,)):
                key = leaf.untyped_storage()._cdata
                if key not in seen:
                    seen.add(key)
                    total += leaf.untyped_storage().nbytes()
    return total


def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 100000 + 3 for i in range(n)]


def decode_chunks(batch: int, context: int, block_size: int, tokens_per_row: int = 1):
    """`batch` rows, each feeding the last `tokens_per_row` of its `context` tokens (own slot, own
    blocks): decode rows, or verification rows [x0, d_0 .. d_{B-1}] with tokens_per_row = 1 + B."""
    from deepinfer.model_executor.forward_meta import SeqChunk
    nb = -(-context // block_size)
    return [SeqChunk(slot=1 + i, ctx_len=context - tokens_per_row, num_new=tokens_per_row,
                     block_table=list(range(1 + i * nb, 1 + (i + 1) * nb)), token_ids=_tokens(context, i),
                     num_logits=tokens_per_row)
            for i in range(batch)]


def prefill_chunks(tokens: int, context: int, block_size: int):
    """The last `tokens`-token chunk of a `context`-token prompt (it reads a full context)."""
    from deepinfer.model_executor.forward_meta import SeqChunk
    nb = -(-context // block_size)
    return [SeqChunk(slot=1, ctx_len=context - tokens, num_new=tokens, block_table=list(range(1, 1 + nb)),
                     token_ids=_tokens(context, 0))]


class ReadCounter(TorchDispatchMode):
    """Bytes a forward reads from the rank's weights, KV cache and Engram tables.

    A gather (index, index_select, embedding, gather) reads the rows it returns; any other op reads
    the byte range of each tracked input view, counted once per step (ranges merged per storage);
    an op whose output aliases an input (views) read nothing from it, and arguments an op writes are
    not reads. Activations are not counted. (Inside the forward's inference_mode the mode also sees
    composite ops such as matmul and to: whichever op first touches a weight's bytes counts them.)"""

    _GATHERS = ("aten.index.Tensor", "aten.index_select.default", "aten.embedding.default",
                "aten.gather.default", "aten.take.default")

    def __init__(self, categories: dict[int, str]):
        super().__init__()
        self.categories = categories                      # storage key -> "weights" | "kv" | "engram"
        self.ranges: dict[int, list[tuple[int, int]]] = {}
        self.gathered = {c: 0 for c in set(categories.values())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an op returning (a view of) its input read nothing: view ops, and `to` / `contiguous` when
        # they return self; the schema's alias marks alone would also skip `to`'s real copies
        aliased = {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        named = list(zip((a.name for a in func._schema.arguments), args)) + list(kwargs.items())
        gather = str(func) in self._GATHERS
        for name, value in named:
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(t, torch.Tensor) or name in written:
                    continue
                key = t.untyped_storage()._cdata
                cat = self.categories.get(key)
                if cat is None or key in aliased:
                    continue
                if gather and name in ("self", "weight", "input"):
                    self.gathered[cat] += out.numel() * out.element_size()
                else:
                    self._touch(key, t)
        return out

    def _touch(self, key: int, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
        lo = t.storage_offset() * t.element_size()
        self.ranges.setdefault(key, []).append((lo, lo + span * t.element_size()))

    def bytes_by_category(self) -> dict[str, int]:
        out = dict(self.gathered)
        for key, spans in self.ranges.items():
            covered, end = 0, -1
            for lo, hi in sorted(spans):
                if hi <= end:
                    continue
                covered += hi - max(lo, end)
                end = hi
            cat = self.categories[key]
            out[cat] = out.get(cat, 0) + covered
        return out


def storage_categories(model, cache, by_component: bool = False) -> dict[int, str]:
    """Storage -> "weights" | "kv" | "engram"; by_component: the weights by their memory_report
    component (attention_linears, shared_expert, routed_experts, embed_head, ...) instead."""
    cats = {}
    for name, t in mr.model_tensors(model).items():
        comp = mr.component_of(name)
        cats[t.untyped_storage()._cdata] = "engram" if comp == "engram_tables" else comp if by_component else "weights"
    for group in (cache.swa, cache.comp_state, cache.entries, cache.index_keys):
        for t in group.values():
            for leaf in (t if isinstance(t, (tuple, list)) else (t,)):
                cats[leaf.untyped_storage()._cdata] = "kv"
    return cats


def run_step(model, cache, layout, chunks, bucket, logits_rows: int, categories: dict | None = None) -> dict:
    """One fixed-shape step on meta: {"tokens", "context", "num_layers", "collectives", "per_layer",
    "outside_layers", "bytes_read"} (bytes by storage_categories, or the given categories)."""
    from deepinfer.model_executor.forward_meta import step_to
    from deepinfer.model_executor.static_step import BucketSpec
    # a prompt bucket holds at least 2 tokens; a 1-row decode step's bucket is its own (num_tokens 1)
    spec = BucketSpec(batch=(bucket.num_seqs,), contexts=(bucket.context,),
                      prefill_tokens=(max(2, bucket.num_tokens),), max_model_len=bucket.context)
    step = step_to(model.host_inputs(spec.static_step(chunks, bucket, layout, logits_rows=logits_rows)), "meta")
    per_layer: list[list[dict]] = []

    def run_layer(layer, x, prev_pre, ctx, io):
        with comm.record_collectives() as log:
            out = layer(x, prev_pre, ctx, io)
        per_layer.append(log)
        return out

    counter = ReadCounter(categories or storage_categories(model, cache))
    with comm.record_collectives() as everything, counter:
        logits = model(step, cache, run_layer=run_layer)
        # a vocabulary-split head leaves the CP group as whole rows here (the candidate form needs values)
        logits = model.full_logits(logits)
    if logits.shape[0] != logits_rows:
        raise RuntimeError(f"dry run: {logits.shape[0]} logits rows, expected {logits_rows}")
    in_layers = sum(len(x) for x in per_layer)
    return {"tokens": bucket.num_tokens, "rows": bucket.num_seqs, "context": bucket.context,
            "kv_bytes_held": cache_bytes(cache),
            "num_layers": len(per_layer), "collectives": everything,
            "per_layer": [len(x) for x in per_layer],
            "max_collectives_per_layer": max((len(x) for x in per_layer), default=0),
            "outside_layers": len(everything) - in_layers,
            "bytes_read": counter.bytes_by_category()}


def run_draft_block(model, cache, layout, batch: int, context: int, nextn: int) -> dict:
    """One DSpark draft block on meta (models/dspark_draft.py): `batch` rows of `nextn` tokens at the
    end of `context`-token sequences, through the fixed-shape MoE (as a compiled block would run; the
    engine runs it eagerly today), then the per-depth Markov and confidence heads the driver runs to
    sample the drafts (their reads count; the draws themselves do not); the keys of run_step's report."""
    import dataclasses

    from deepinfer.model_executor.forward_meta import step_to
    from deepinfer.model_executor.models import dspark_draft
    from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
    block = DraftBlock(list(range(1, batch + 1)), [context - 1] * batch, _tokens(batch, 1), nextn)
    step = draft_step_inputs(block, layout, int(model.cfg.dspark_noise_token_id))
    step = step_to(dataclasses.replace(step, static_shapes=True), "meta")
    counter = ReadCounter(storage_categories(model, cache))
    with comm.record_collectives() as everything, counter:
        hidden, logits = model.draft(step, cache)
        # then the driver, depth by depth (spec/proposer.py): the Markov and confidence heads
        prev = step.input_ids.view(batch, nextn)[:, 0]
        for k in range(nextn):
            pe = dspark_draft.markov_embed(model, prev)
            (logits.view(batch, nextn, -1)[:, k] + dspark_draft.markov_logits(model, pe)).argmax(dim=-1)
            dspark_draft.confidence(model, hidden.view(batch, nextn, -1)[:, k], pe)
    if logits.shape[0] != batch * nextn:
        raise RuntimeError(f"dry run: {logits.shape[0]} draft rows, expected {batch * nextn}")
    read = counter.bytes_by_category()
    # ReadCounter counts a tensor once a step; the Markov head's [V, r] weight is read again at every
    # depth (too large to stay on chip), the rest of the per-depth heads are small
    head = mr.model_tensors(model.mtp[-1].markov_head.head)
    read["weights"] = read.get("weights", 0) + (nextn - 1) * sum(t.numel() * t.element_size() for t in head.values())
    return {"tokens": batch * nextn, "rows": batch, "context": context, "kv_bytes_held": cache_bytes(cache),
            "num_layers": len(model.mtp), "collectives": everything, "bytes_read": read}


def speculative_estimate(decode: dict, verify: dict, draft: dict, nextn: int) -> dict:
    """ESTIMATE: a speculative step (verification + draft block) against a plain decode step, at the
    floors of floor_estimate; break-even = the tokens per step a speculative step must emit to match
    plain decoding's tokens per second (what the drafts' acceptance has to reach)."""
    out = {"label": "ESTIMATE (not measured)", "nextn": nextn}
    for key in ("floor_hw_ms", "floor_seed_latency_ms"):
        plain = decode["floor_estimate"][key]
        spec = verify["floor_estimate"][key] + draft["floor_estimate"][key]
        out[key] = {"plain_step": plain, "speculative_step": spec, "break_even_tokens_per_step": spec / plain,
                    "reachable": spec / plain <= 1 + nextn}
    return out


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def rank_bytes(model, cache, layout: ParallelLayout) -> dict:
    from deepinfer.distributed.shared_tables import table_bytes
    from deepinfer.model_executor.layers.engram_host import engram_device_bytes
    resident = mr.resident_bytes(model)
    tables = table_bytes(model)
    if tables != resident["engram_tables"]:
        raise RuntimeError(f"Engram tables: {tables} bytes as shared segments, {resident['engram_tables']} held")
    return {"rank": layout.rank, "lane_rank": layout.lane_rank, "ep_rank": layout.ep_rank,
            "weights_bytes": resident["total"] - tables, "kv_bytes": cache_bytes(cache),
            "engram_bytes": -(-tables // layout.ranks_per_node), "engram_hbm_bytes": engram_device_bytes(model),
            "components": {c: resident[c] for c in mr.COMPONENTS if c != "engram_tables"}}


def dry_run(cfg, cp: int = 1, ep: int = 1, attn_tp: int | None = None, nnodes: int = 1, steps: bool = True,
            batch: int = 8, context: int = 4096, prefill_tokens: int = 128, dtype=torch.bfloat16,
            kv_cache_mode: str = "plain", ranks=None, log=None, nextn: int = 0, decode_steps=None,
            cache_slots: int | None = None) -> dict:
    """The report of the module docstring. attn_tp defaults to min(cp, 8) (the engine's lane default);
    ranks: the ranks to walk (default all); nextn: drafts per row (speculative steps too);
    decode_steps: predicted decode steps, fn(model, cfg, layout, context, dtype, kv_cache_mode, log) ->
    {rows: step} run on the first shard class ("decode_steps"; tools/step_prediction.py predictor);
    cache_slots: the cache's state slots (dry_run_cache; default the steps' rows + 1)."""
    from deepinfer.model_executor.static_step import Bucket
    attn_tp = attn_tp or min(cp, 8)
    cache_slots = max(batch + 1, cache_slots or 0)
    world = max(cp, ep)
    ParallelLayout(0, cp, ep, attn_tp, nnodes).check_model(cfg)
    classes: dict[tuple, dict] = {}
    rows = []
    for r in (range(world) if ranks is None else ranks):
        layout = ParallelLayout(r, cp, ep, attn_tp, nnodes)
        with fake_world(r, world):
            groups = ParallelGroups.create(layout)
            model = build_rank_model(cfg, groups, dtype)
            cache, cache_layout, bs = dry_run_cache(cfg, batch, context, dtype, kv_cache_mode, model.engram_spec,
                                                    nextn, cache_slots)
            rows.append(rank_bytes(model, cache, layout))
            sig = shard_signature(model, layout)
            cls = classes.setdefault(sig, {"ranks": []})
            cls["ranks"].append(r)
            if steps and "decode_step" not in cls:
                if log:
                    log(f"rank {r}: new shard class, running the decode step and the prompt chunk")
                cls["decode_step"] = run_step(model, cache, cache_layout, decode_chunks(batch, context, bs),
                                              Bucket(batch, batch, context), logits_rows=batch)
                cls["prefill_chunk"] = run_step(model, cache, cache_layout,
                                                prefill_chunks(prefill_tokens, context, bs),
                                                Bucket(1, prefill_tokens, context), logits_rows=1)
                if decode_steps is not None:
                    cls["decode_steps"] = decode_steps(model, cfg, layout, context, dtype, kv_cache_mode, log)
                if nextn:
                    model.enable_drafting()   # from here the main forward also writes the draft keys
                    q = 1 + nextn
                    cls["verify_step"] = run_step(model, cache, cache_layout, decode_chunks(batch, context, bs, q),
                                                  Bucket(batch, batch * q, context), logits_rows=batch * q)
                    cls["draft_block"] = run_draft_block(model, cache, cache_layout, batch, context, nextn)
            del model, cache
    report = {"config": {"model_type": cfg.model_type, "num_layers": cfg.num_layers},
              "layout": {"cp": cp, "ep": ep, "attn_tp": attn_tp, "nnodes": nnodes, "world_size": world,
                         "ranks_per_node": world // nnodes},
              "sharded": world == 1 or model_takes_parallel(),
              "dtype": str(dtype).removeprefix("torch."), "kv_cache_mode": kv_cache_mode,
              "step_shapes": {"decode_rows": batch, "context": context, "prefill_tokens": prefill_tokens,
                              "nextn": nextn, "cache_slots": cache_slots},
              "engram_accounting": "engram_bytes = one host's shared Engram tables / ranks per host (host "
                                   "memory, not HBM); weights_bytes excludes them",
              "ranks": rows,
              "shard_classes": [{"ranks": c["ranks"]} for c in classes.values()]}
    if steps:
        first = next(iter(classes.values()))
        keys = STEP_KEYS if nextn else STEP_KEYS[:2]
        for key in keys:
            report[key] = {**first[key], "same_for_ranks": first["ranks"],
                           "floor_estimate": floor_estimate(first[key])}
        if decode_steps is not None:
            report["decode_steps"] = {r: {**st, "same_for_ranks": first["ranks"]} for r, st in first["decode_steps"].items()}
        if nextn:
            report["speculative_estimate"] = speculative_estimate(report["decode_step"], report["verify_step"],
                                                                  report["draft_block"], nextn)
        if len(classes) > 1:
            report["other_classes"] = [{"ranks": c["ranks"], **{k: c[k] for k in keys}}
                                       for c in list(classes.values())[1:]]
    return report


STEP_KEYS = ("decode_step", "prefill_chunk", "verify_step", "draft_block")
STEP_TITLES = {"decode_step": "decode step", "prefill_chunk": "prompt chunk",
               "verify_step": "verification step", "draft_block": "draft block"}


def _seed_latency(group_size: int) -> float:
    return SEED_LATENCY_S[8] if group_size <= 8 else SEED_LATENCY_S[64]


def floor_estimate(step: dict) -> dict:
    """ESTIMATE of a step's lower bound on trn2 (nothing measured): the bytes it reads at one rank's
    HBM bandwidth, plus its collectives one after another at a fixed latency each (documented hardware
    latency, or the seed's measured latency by group size); payload time and compute are left out.
    KV reads count at most the cache once: the reference path gathers each token's rows separately,
    which a prompt chunk's kernel would not."""
    br = step["bytes_read"]
    read = sum(v for c, v in br.items() if c != "kv") + min(br.get("kv", 0), step["kv_bytes_held"])
    hbm_s = read / TRN2_HBM_BYTES_PER_S_PER_RANK
    n = len(step["collectives"])
    hw_s = n * COLLECTIVE_LATENCY_HW_S
    seed_s = sum(_seed_latency(c["group_size"]) for c in step["collectives"])
    return {"label": "ESTIMATE (not measured)", "bytes_read": read, "hbm_ms": hbm_s * 1e3,
            "collectives": n, "collectives_hw_ms": hw_s * 1e3, "collectives_seed_ms": seed_s * 1e3,
            "floor_hw_ms": (hbm_s + hw_s) * 1e3, "floor_seed_latency_ms": (hbm_s + seed_s) * 1e3,
            "assumptions": {"hbm_bytes_per_s_per_rank": TRN2_HBM_BYTES_PER_S_PER_RANK,
                            "collective_latency_hw_s": COLLECTIVE_LATENCY_HW_S,
                            "seed_latency_s_by_group_size": {"<=8": SEED_LATENCY_S[8], ">8": SEED_LATENCY_S[64]},
                            "sources": FLOOR_SOURCES}}


def collective_summary(collectives: list[dict]) -> list[dict]:
    """[{"op", "group_size", "bytes", "count"}] of a step's collectives, in first-seen order."""
    out: dict[tuple, dict] = {}
    for c in collectives:
        key = (c["op"], c["group_size"], c["bytes"])
        out.setdefault(key, {**c, "count": 0})["count"] += 1
    return list(out.values())


def format_dry_run(report: dict) -> str:
    gib = 2 ** 30
    lay = report["layout"]
    rows = report["ranks"]
    lines = [f"dry run: cp={lay['cp']} ep={lay['ep']} attn_tp={lay['attn_tp']} world={lay['world_size']} "
             f"nodes={lay['nnodes']} ({report['dtype']}, kv {report['kv_cache_mode']}, "
             f"{len(report['shard_classes'])} shard class(es))"]
    w = [r["weights_bytes"] for r in rows]
    k = [r["kv_bytes"] for r in rows]
    e = [r["engram_bytes"] for r in rows]
    lines.append(f"{'per rank':24s} {'min GiB':>9s} {'max GiB':>9s}")
    for label, vals in (("weights", w), ("KV cache", k), ("Engram (host share)", e)):
        lines.append(f"{label:24s} {min(vals) / gib:9.3f} {max(vals) / gib:9.3f}")
    target = 17 * gib
    lines.append(f"weights <= 17 GiB a rank: {'yes' if max(w) <= target else 'NO'} (max {max(w) / gib:.2f} GiB)")
    lines.append(f"Engram: {report['engram_accounting']}")
    for key, title in STEP_TITLES.items():
        if key not in report:
            continue
        s, f = report[key], report[key]["floor_estimate"]
        lines.append(f"-- {title}: {s['tokens']} tokens in {s['rows']} rows, context {s['context']}, "
                     f"{s['num_layers']} {'draft' if key == 'draft_block' else 'decoder'} layers")
        if "max_collectives_per_layer" in s:
            lines.append(f"   collectives: {len(s['collectives'])} ({s['max_collectives_per_layer']} per layer at "
                         f"most, {s['outside_layers']} outside the layers)")
        else:
            lines.append(f"   collectives: {len(s['collectives'])}")
        for c in collective_summary(s["collectives"]):
            lines.append(f"     {c['count']:4d} x {c['op']:14s} group {c['group_size']:3d}  {c['bytes']:>10d} B")
        br = s["bytes_read"]
        lines.append("   bytes read per rank: " + ", ".join(f"{c} {v / gib:.3f} GiB" for c, v in sorted(br.items())))
        lines.append(f"   {f['label']}: HBM {f['hbm_ms']:.2f} ms (at {TRN2_HBM_BYTES_PER_S_PER_RANK / 1e12:.2f} TB/s "
                     f"a rank) + collectives {f['collectives_hw_ms']:.2f} ms at "
                     f"{COLLECTIVE_LATENCY_HW_S * 1e6:.0f} us each = {f['floor_hw_ms']:.2f} ms; with the seed's "
                     f"measured latencies {f['collectives_seed_ms']:.1f} ms -> {f['floor_seed_latency_ms']:.1f} ms")
    if "speculative_estimate" in report:
        est = report["speculative_estimate"]
        for key, what in (("floor_hw_ms", "documented latencies"), ("floor_seed_latency_ms", "the seed's latencies")):
            e = est[key]
            lines.append(f"speculative step (nextn {est['nextn']}, {est['label']}, {what}): verification + draft "
                         f"{e['speculative_step']:.2f} ms vs plain {e['plain_step']:.2f} ms: it pays off above "
                         f"{e['break_even_tokens_per_step']:.2f} tokens per step (at most {1 + est['nextn']})")
    for rows, st in report.get("decode_steps", {}).items():
        parts = st["predicted_ms_parts"]
        lines.append(f"-- predicted decode step, {rows} row(s), context {st['context']} ({st['label']}):")
        lines.append(f"   bytes read a rank: expected {st['bytes_read_expected'] / gib:.3f} GiB, worst "
                     f"{st['bytes_read_worst'] / gib:.3f} GiB (routed experts {st['routed_experts']['form']}, "
                     f"{st['routed_experts']['expected_experts_per_layer']:.3f} of "
                     f"{st['routed_experts']['local_experts']} a layer expected)")
        lines.append(f"   predicted {st['predicted_ms']:.2f} ms (worst {st['predicted_ms_worst']:.2f}) = fp8 kernels "
                     f"{parts['fp8_kernels']:.2f} + routed experts {parts['routed_experts']:.2f} + bandwidth "
                     f"{parts['bandwidth']:.2f} + {st['collective_count']} collectives "
                     f"{parts['collectives']:.2f} at {st['assumptions']['collective_latency_s'] * 1e6:.0f} us")
    if "decode_step" in report:
        ok = report["decode_step"]["max_collectives_per_layer"] <= 2
        lines.append(f"at most 2 collectives per decoder layer in a decode step: {'yes' if ok else 'NO'}")
    lines.append(f"sources: {FLOOR_SOURCES}")
    return "\n".join(lines)

