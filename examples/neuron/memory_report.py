"""Weight bytes of the model as the engine builds it, next to the same tensors in their checkpoint
formats, by component; builds on the meta device, so nothing is allocated.

    python examples/neuron/memory_report.py --config examples/configs/v41-flash.json [--json OUT]
        [--dtype bfloat16] [--post-load] [--dense-checkpoint] [--platform cpu]

--post-load also counts what `model.post_load()` adds once weights are loaded (the stacked expert
copies). --dense-checkpoint counts a config without quantization_config as stored unquantized
(default: DeepSeek's fp8/fp4 release format). See deepinfer/tools/memory_report.py.

With --cp / --ep it is the full-scale dry run instead (deepinfer/tools/dry_run.py): every
rank's shard built on meta under a fake process group, its weight / KV / Engram bytes, and with
--step one decode step and one prompt chunk per distinct shard, their collectives and a labelled
floor estimate on trn2:

    python examples/neuron/memory_report.py --config examples/configs/v41-flash.json --cp 64 --ep 64 \
        --step [--output out.json] [--attn-tp 8] [--nnodes 1] [--batch 8] [--context 4096] [--prefill-tokens 128]
        [--nextn 5]

--rows 1,8 adds predicted decode steps of those row counts ("decode_steps": bytes read expected under
uniform routing and worst case, the collectives, a predicted time from the kernel cost model, the HBM
bandwidth and --collective-latency-us [25]; every number an ESTIMATE; deepinfer/tools/step_prediction.py):

    python examples/neuron/memory_report.py --config examples/configs/v41-flash.json --cp 64 --ep 64 \
        --step --rows 1,8 [--collective-latency-us 25] --json out.json

--nextn B adds speculative decoding: the verification step (rows of 1 + B tokens), one DSpark draft
block, and the tokens per step a speculative step must emit to beat plain decoding at those floors.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.tools.memory_report import format_report, memory_report  # noqa: E402
from deepinfer.tools.dry_run import dry_run, format_dry_run  # noqa: E402
from deepinfer.tools.step_prediction import predictor  # noqa: E402


def load_config(path: str) -> ModelConfig:
    if os.path.isdir(path):
        return ModelConfig.from_pretrained(path)
    with open(path) as f:
        return ModelConfig.from_dict(json.load(f))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json or a checkpoint directory")
    ap.add_argument("--json", help="write the report here as JSON")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    ap.add_argument("--post-load", action="store_true", help="also run model.post_load() before counting")
    ap.add_argument("--weight-format", default="packed", choices=["packed", "dense"],
                    help="the engine's weight_format (default packed, as on neuron and cuda)")
    ap.add_argument("--dense-checkpoint", action="store_true",
                    help="without quantization_config, count the checkpoint as unquantized")
    ap.add_argument("--platform", default=None, choices=["cpu", "cuda", "neuron"],
                    help="platform whose kernel table the model is built with (default: none, the references)")
    dry = ap.add_argument_group("full-scale dry run (any of --cp / --ep / --step)")
    dry.add_argument("--cp", type=int, default=None, help="context_parallel_size")
    dry.add_argument("--ep", type=int, default=None, help="expert_parallel_size")
    dry.add_argument("--attn-tp", type=int, default=None, help="attention lane size (default min(cp, 8))")
    dry.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over")
    dry.add_argument("--step", action="store_true", help="also run a decode step and a prompt chunk per shard")
    dry.add_argument("--batch", type=int, default=8, help="decode rows")
    dry.add_argument("--context", type=int, default=4096, help="context length of the steps")
    dry.add_argument("--prefill-tokens", type=int, default=128, help="prompt chunk tokens")
    dry.add_argument("--kv-cache-mode", default="plain", choices=["plain", "compact"])
    dry.add_argument("--nextn", type=int, default=0,
                     help="with --step: drafts per row; also runs the verification step and the draft block")
    dry.add_argument("--output", help="write the dry run's JSON here (--json works too)")
    dry.add_argument("--rows", default="", help="with --step: comma-separated row counts of predicted decode steps")
    dry.add_argument("--cache-slots", type=int, default=None,
                     help="the KV cache's state slots, e.g. a serving config's max_num_seqs + 1 (each holds its "
                          "SWA and compressor rings; default: the step's rows + 1)")
    dry.add_argument("--collective-latency-us", type=float, default=25.0,
                     help="with --rows: the latency of one collective in the predicted steps")
    args = ap.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows: comma-separated positive ints, got {args.rows!r}")
    if any(r < 1 for r in args.rows) or (args.rows and not args.step):
        ap.error("--rows: positive row counts, and only with --step")
    if args.collective_latency_us < 0:
        ap.error("--collective-latency-us: a latency >= 0")
    if args.nextn < 0 or (args.nextn and not args.step):
        ap.error("--nextn: a count >= 0, and only with --step")
    cfg = load_config(args.config)
    if args.cp is not None or args.ep is not None or args.step:
        if args.platform or args.post_load or args.weight_format != "packed" or args.dense_checkpoint:
            ap.error("the dry run builds what build_model holds (packed weights, post_load, the reference "
                     "kernels, whose reads it counts): drop --platform / --post-load / --weight-format / "
                     "--dense-checkpoint")
        return _dry_run(args, cfg)
    platform = None
    if args.platform:
        from deepinfer.platforms import make_platform
        platform = make_platform(args.platform)
    report = {"config": args.config, **memory_report(cfg, getattr(torch, args.dtype), platform=platform,
                                                     post_load=args.post_load,
                                                     dense_checkpoint=args.dense_checkpoint,
                                                     weight_format=args.weight_format)}
    print(f"{args.config} ({cfg.model_type}, {args.dtype}, weight_format={args.weight_format}"
          f"{', after post_load' if args.post_load else ''})")
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return report


def _dry_run(args, cfg) -> dict:
    report = {"config_path": args.config,
              **dry_run(cfg, cp=args.cp or 1, ep=args.ep or 1, attn_tp=args.attn_tp, nnodes=args.nnodes,
                        steps=args.step, batch=args.batch, context=args.context,
                        prefill_tokens=args.prefill_tokens, dtype=getattr(torch, args.dtype),
                        kv_cache_mode=args.kv_cache_mode, nextn=args.nextn, cache_slots=args.cache_slots,
                        decode_steps=predictor(args.rows, args.collective_latency_us * 1e-6,
                                               cache_slots=args.cache_slots) if args.rows else None,
                        log=lambda m: print(m, file=sys.stderr))}
    print(format_dry_run(report))
    out = args.output or args.json
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
    return report


if __name__ == "__main__":
    main()
