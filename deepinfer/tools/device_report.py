"""Full-scale device report: every graph a Neuron engine compiles, traced at full shapes on meta under
the fake process group, and what a rank holds in HBM (docs/neuron.md §4, §5.10).

`device_report(cfg, cp, ep, nextn)` builds rank 0's shard of the model on the meta device inside the
fake world of `max(cp, ep)` ranks (tools/dry_run.py `fake_world`, `build_rank_model`: packed weights,
post_load), its KV cache for the engine's serving config (`max_num_seqs` rows of `max_model_len`
tokens plus the scratch slot and block), and runs the Neuron runner itself
(worker/runners/neuron_regions.py) on meta over every bucket warm-up walks, with a RegionRunner whose
backend records each graph Dynamo hands it (`TracedGraphs`). Ranks are symmetric: every rank holds
the same tensor shapes (its own slices and experts) and runs the same graphs
(dry_run.shard_signature says which ranks match; the report walks rank 0 and states the class).

Per graph: its region, layer kind, tokens and context bucket; `max_intermediate_bytes`, the largest
tensor any op of the graph produces when the graph runs on meta (`measure.largest_output_bytes`);
`float8_sites` (neuron_ops/fp8_guard.py graph_fp8_sites, §4 A2/A3) and `int64_sites`
(`measure.int64_sites`, §4 A4/A5). Per rank: HBM bytes of the weights, KV cache, Engram tables held
as device tensors, the largest intermediate of any graph, and their total. `decode_step`: the op
census (neuron_ops/op_census.py) of the plan's largest plain decode bucket on meta; with drafts,
`speculative_step`: the census of a greedy verification step run as one device program (the forward,
then the acceptance and the next draft block with its argmax drafts in the verify_draft region:
spec/greedy_step.py), and `speculative_step_host_draws` a step verified on the host: the forward, the
draft block, and the per-depth heads run eagerly for host-sampled drafts. `rules`: the
device-rule table (platforms/neuron/device_rules.py). Nothing here ran on a device.
"""
from __future__ import annotations

import time

import torch

from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.tools import dry_run as dr
from deepinfer.tools import memory_report as mr
from deepinfer.tools.device_measure import TracedGraphs, engram_device_bytes

GIB = 1 << 30
HBM_TARGET_BYTES = 22 * GIB           # a logical core's ~24 GiB less headroom (docs/neuron.md §1.1)
INTERMEDIATE_TARGET_BYTES = 256 << 20  # the largest tensor a graph may produce (docs/neuron.md §4 B7)
GRAPH_TARGET = 64                     # the default serving config's compile budget (§5.10)
# the report's fields a device rule may name as its check (platforms/neuron/device_rules.py)
REPORT_FIELDS = ("graphs[].max_intermediate_bytes", "graphs[].float8_sites", "graphs[].int64_sites",
                 "ranks[].hbm_bytes.total", "ranks[].hbm_bytes.engram", "graph_count", "decode_step.eager_ops",
                 "decode_step.host_to_device_copies", "decode_step.device_to_host_copies")


class _MetaPlatform:
    """The host-mode NeuronPlatform with its device set to meta (shapes only, no storage)."""

    def __init__(self, host):
        self._host = host

    def __getattr__(self, name):
        return getattr(self._host, name)

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    fp8_guard = False
    rank = 0


def device_report(cfg, cp: int = 64, ep: int = 64, nextn: int = 0, log=None, **engine) -> dict:
    """The report of the module docstring; engine: EngineConfig fields (defaults otherwise)."""
    from deepinfer.engine_config import EngineConfig
    from deepinfer.neuron_ops.op_census import EAGER_OPS_TARGET, OpCensus
    from deepinfer.platforms.neuron.device_rules import report_rules
    from deepinfer.platforms.neuron.platform import NeuronPlatform
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    t0 = time.perf_counter()
    ec = EngineConfig(model="unused", num_speculative_tokens=nextn, **engine)
    ec.resolve(cfg)
    host = NeuronPlatform(host=True)
    host.validate_config(ec, cfg)
    spec = host.bucket_spec(ec)
    world, attn_tp = max(cp, ep), min(cp, 8)
    layout = ParallelLayout(0, cp, ep, attn_tp, 1)
    layout.check_model(cfg)
    traced = TracedGraphs(split=host.region_split)
    with dr.fake_world(0, world):
        groups = ParallelGroups.create(layout)
        model = dr.build_rank_model(cfg, groups, torch.bfloat16, platform=host)
        if nextn:
            model.enable_drafting()
        cache, cache_layout, _ = dr.dry_run_cache(cfg, ec.max_num_seqs, ec.max_model_len, torch.bfloat16,
                                                  ec.kv_cache_mode, model.engram_spec, nextn)
        strategy = NeuronRegionStrategy(model, cache_layout, _MetaPlatform(host), spec, regions=traced.runner)
        if log:
            log(f"plan: {strategy.plan.describe()}")
        traced.trace_plan(strategy, cache, log=log)
        census = OpCensus()
        strategy.census = census
        decode = max((b for b in spec.all_buckets() if b.num_tokens == b.num_seqs), key=lambda b: b.num_seqs)
        step = spec.static_step([], decode, cache_layout, logits_rows=decode.num_tokens)
        strategy.forward(strategy.to_device(step, decode), cache, decode)
        plain = census.steps[-1]
        speculative = speculative_census(strategy, cache) if nextn else None
        host_drawn = speculative_census(strategy, cache, argmax=False) if nextn else None
        strategy.census = None
        resident = mr.resident_bytes(model)
        engram = engram_device_bytes(model)
        kv = dr.cache_bytes(cache)
        sig = dr.shard_signature(model, layout)
    graphs = traced.rows()
    peak = max((g["max_intermediate_bytes"] for g in graphs), default=0)
    weights = resident["total"] - resident["engram_tables"]
    step_census = plain
    report = {
        "config": {"model_type": cfg.model_type, "num_layers": cfg.num_layers, "kv_cache_mode": ec.kv_cache_mode,
                   "max_num_seqs": ec.max_num_seqs,
                   "max_model_len": ec.max_model_len, "max_num_batched_tokens": ec.max_num_batched_tokens,
                   "nextn": nextn},
        "layout": {"cp": cp, "ep": ep, "attn_tp": attn_tp, "world_size": world},
        "graphs": graphs,
        "graph_count": len(graphs),
        "planned_graph_count": strategy.plan.graph_count,
        "ranks": [{"rank": 0, "represents": "every rank (symmetric shards: the same tensor shapes and groups)",
                   "shard_signature_tensors": len(sig[0]),
                   "hbm_bytes": {"weights": weights, "kv": kv, "engram": engram, "peak_intermediate": peak,
                                 "total": weights + kv + engram + peak}}],
        "decode_step": {"bucket": step_census.label, "eager_ops": step_census.num_eager_ops,
                        "host_to_device_copies": step_census.host_to_device,
                        "device_to_host_copies": step_census.device_to_host,
                        "ops": step_census.to_dict()["ops"]},
        "speculative_step": None if speculative is None else speculative.to_dict(),
        "speculative_step_host_draws": None if host_drawn is None else host_drawn.to_dict(),
        "targets": {"hbm_total_bytes": HBM_TARGET_BYTES, "max_intermediate_bytes": INTERMEDIATE_TARGET_BYTES,
                    "graph_count": GRAPH_TARGET, "eager_ops": EAGER_OPS_TARGET, "copies_each_way": 1},
        "rules": report_rules(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report["checks"] = check_targets(report)
    return report


def speculative_census(strategy, cache, argmax: bool = True):
    """The census of one speculative step of the largest verification row bucket. argmax: every row
    greedy with argmax drafts, so the step is one device program (the verification forward, then the
    acceptance and next draft block in the verify_draft region: spec/greedy_step.py); else rows the host
    samples: the verification forward, the draft block, then the per-depth draft heads as the driver
    runs them (spec/proposer.py; the acceptance and draws on the host left out)."""
    from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
    from deepinfer.model_executor.static_step import Bucket
    from deepinfer.platforms.neuron.compile_plan import exit_logits_rows
    spec, b = strategy.buckets, strategy.drafts
    rows = max(spec.verify_batch)
    if argmax:
        bucket = max(strategy.greedy_spec_buckets(), key=lambda br: br[1])[0]
        strategy.greedy_spec_placeholders(bucket, rows, cache)
        return strategy.census.steps[-1]
    verify = Bucket(rows, spec.verify_bucket_tokens(rows), max(spec.context_ladder()))
    step = spec.static_step([], verify, strategy.layout, logits_rows=exit_logits_rows(verify, spec))
    strategy.forward(strategy.to_device(step, verify), cache, verify)
    block = DraftBlock([], [], [], b).padded(rows)
    noise = int(strategy.model.cfg.dspark_noise_token_id)
    packed = strategy.draft_to_device(draft_step_inputs(block, strategy.layout, noise))
    hidden, base = strategy.forward_draft(packed, cache)
    hidden, base = hidden[:rows * b].view(rows, b, -1), base[:rows * b].view(rows, b, -1)
    prev = torch.zeros(rows, dtype=torch.long, device=hidden.device)
    for k in range(b):
        strategy.draft_heads(hidden[:, k], base[:, k], prev)
    return strategy.census.steps[-1]


def check_targets(report: dict) -> dict:
    """Each target of the report: held or not (measured values only)."""
    t, rank = report["targets"], report["ranks"][0]["hbm_bytes"]
    graphs, step = report["graphs"], report["decode_step"]
    return {
        "hbm_total": rank["total"] <= t["hbm_total_bytes"],
        "engram_in_hbm_zero": rank["engram"] == 0,
        "float8_sites_zero": all(not g["float8_sites"] for g in graphs),
        "int64_sites_zero": all(not g["int64_sites"] for g in graphs),
        "max_intermediate": all(g["max_intermediate_bytes"] <= t["max_intermediate_bytes"] for g in graphs),
        "graph_count": report["graph_count"] <= t["graph_count"],
        "graphs_match_plan": report["graph_count"] == report["planned_graph_count"],
        "eager_ops": step["eager_ops"] <= t["eager_ops"],
        "copies": step["host_to_device_copies"] <= 1 and step["device_to_host_copies"] <= 1,
        **speculative_checks(report),
    }


def speculative_checks(report: dict) -> dict:
    """With drafts: the speculative step (greedy rows, argmax drafts) within the eager-op target, each of
    its phases (the verification forward, the acceptance and draft block) at most one copy each way, and
    the whole step one copy each way (one device program: spec/greedy_step.py)."""
    spec = report.get("speculative_step")
    if not spec:
        return {}
    t, by = report["targets"], spec["by_phase"]
    return {
        "speculative_eager_ops": spec["eager_ops"] <= t["eager_ops"],
        "speculative_copies_a_program": all(by[p].get("host_to_device", 0) <= 1 and by[p].get("device_to_host", 0) <= 1
                                            for p in ("step", "draft")),
        "speculative_copies_a_step": spec["host_to_device_copies"] <= 1 and spec["device_to_host_copies"] <= 1,
    }


def format_report(report: dict) -> str:
    r = report["ranks"][0]["hbm_bytes"]
    lines = [f"{report['config']['model_type']} cp={report['layout']['cp']} ep={report['layout']['ep']} "
             f"nextn={report['config']['nextn']}: {report['graph_count']} graphs "
             f"(plan {report['planned_graph_count']}), traced in {report['seconds']} s",
             "per-rank HBM (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in r.items()),
             f"decode step {report['decode_step']['bucket']}: {report['decode_step']['eager_ops']} eager ops, "
             f"{report['decode_step']['host_to_device_copies']} H2D, "
             f"{report['decode_step']['device_to_host_copies']} D2H",
             *([] if not report.get("speculative_step") else [
                 f"speculative step {report['speculative_step']['label']}: "
                 f"{report['speculative_step']['eager_ops']} eager ops, "
                 f"{report['speculative_step']['host_to_device_copies']} H2D, "
                 f"{report['speculative_step']['device_to_host_copies']} D2H (host-sampled drafts: "
                 f"{report['speculative_step_host_draws']['eager_ops']} eager ops, "
                 f"{report['speculative_step_host_draws']['host_to_device_copies']} H2D, "
                 f"{report['speculative_step_host_draws']['device_to_host_copies']} D2H)"]),
             "graph                         tokens  context  max intermediate (MiB)  float8  int64"]
    for g in report["graphs"]:
        lines.append(f"{g['name']:28s} {g['tokens']:7d} {g['context']:8d} {g['max_intermediate_bytes'] / 2**20:22.1f} "
                     f"{len(g['float8_sites']):7d} {len(g['int64_sites']):6d}")
    lines.append("targets: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in report["checks"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json
    import os

    from deepinfer.config import ModelConfig
    ap = argparse.ArgumentParser(description="Full-scale Neuron device report on meta (docs/neuron.md §4)")
    ap.add_argument("--config", required=True, help="config.json of the model (or its directory)")
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--nextn", type=int, default=0, help="speculative decoding: DSpark draft tokens a row")
    ap.add_argument("--json", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
    with open(path) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    report = device_report(cfg, args.cp, args.ep, args.nextn, log=lambda m: print(m, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
