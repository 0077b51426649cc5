"""Bytes per token and per sequence of a model's KV cache, without allocating anything.

    python examples/tools/kv_cache_report.py --config examples/configs/v41-flash.json [--mode plain|compact|both]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.worker.cache_engine import kv_cache_report  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="config.json or a checkpoint directory")
    ap.add_argument("--mode", default="both", choices=["plain", "compact", "both"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=65536, help="context length for the per-sequence total")
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(args.config) if os.path.isdir(args.config) else \
        ModelConfig.from_dict(json.load(open(args.config)))
    modes = ["plain", "compact"] if args.mode == "both" else [args.mode]
    for mode in modes:
        r = kv_cache_report(cfg, mode, getattr(torch, args.dtype))
        total = r["bytes_per_sequence_fixed"] + r["bytes_per_token"] * args.context
        print(f"{cfg.model_type} {mode:7s}: {r['bytes_per_token']:9.1f} B/token growth "
              f"(entries {r['detail']['entries']:.1f}, index {r['detail']['index']:.1f}); fixed per sequence "
              f"{r['bytes_per_sequence_fixed'] / 2**20:7.2f} MiB (SWA {r['detail']['swa'] / 2**20:.2f}, state "
              f"{r['detail']['state'] / 2**10:.1f} KiB); {args.context} tokens: {total / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
