"""Per NKI kernel at V4.1-Flash decode shapes: instruction counts by engine and bytes moved, counted
by the NKI interpreter while it runs the kernel on random weights, and a roofline estimate of its
trn2 time, next to the seed's measured kernel figures.

The logic lives in deepinfer/tools/kernel_report.py; this is its command line.

    python examples/neuron/kernel_report.py --config examples/configs/v41-flash.json [--rows 1,64] \
        [--json kernel_report.json] [--scale 1]

--scale N divides every width by N (a fast run at small shapes; the test uses it).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.tools.kernel_report import ASSUMPTIONS, format_table, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json or a checkpoint directory")
    ap.add_argument("--rows", default="1,64", help="decode rows M, comma-separated")
    ap.add_argument("--scale", type=int, default=1, help="divide every width by this (fast small run)")
    ap.add_argument("--json", default="kernel_report.json", help="where to write the JSON report")
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(args.config) if os.path.isdir(args.config) else \
        ModelConfig.from_dict(json.load(open(args.config)))
    rows = [int(r) for r in args.rows.split(",")]
    report = run(cfg, rows, args.scale)
    print(format_table(report))
    with open(args.json, "w") as f:
        json.dump({"assumptions": ASSUMPTIONS, "scale": args.scale, "kernels": report}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
