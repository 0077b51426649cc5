"""Weight bytes of the model as the engine builds it, next to the same tensors in their checkpoint
formats, by component; builds on the meta device, so nothing is allocated.

    python examples/neuron/memory_report.py --config examples/configs/v41-flash.json [--json OUT]
        [--dtype bfloat16] [--post-load] [--dense-checkpoint] [--platform cpu]

--post-load also counts what `model.post_load()` adds once weights are loaded (the stacked expert
copies). --dense-checkpoint counts a config without quantization_config as stored unquantized
(default: DeepSeek's fp8/fp4 release format). See deepinfer/model_executor/memory_report.py.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.model_executor.memory_report import format_report, memory_report  # noqa: E402


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
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
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


if __name__ == "__main__":
    main()
