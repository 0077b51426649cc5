"""Per NKI kernel at V4.1-Flash decode shapes: instruction counts by engine and bytes moved, counted
by the NKI interpreter while it runs the kernel on random weights, and a roofline estimate of its
trn2 time, next to the seed's measured kernel figures.

The logic lives in deepinfer/tools/kernel_report.py; this is its command line.

    python examples/neuron/kernel_report.py --config examples/configs/v41-flash.json [--rows 1,64] \
        [--json kernel_report.json] [--scale 1]

--scale N divides every width by N (a fast run at small shapes; the test uses it). The cost model's
rows (name, shape, predicted_ms, roofline_ms, seed_measured_ms, seed_design_predicted_ms; ESTIMATE)
come first, at the seed's two measured shapes (K and N divided by --scale; the measurement only at 1).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.tools.kernel_report import ASSUMPTIONS, cost_report, format_table, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json or a checkpoint directory")
    ap.add_argument("--rows", default="1,64", help="decode rows M, comma-separated")
    ap.add_argument("--scale", type=int, default=1, help="divide every width by this (fast small run)")
    ap.add_argument("--json", default="kernel_report.json", help="where to write the JSON report")
    ap.add_argument("--no-cost", action="store_true",
                    help="skip the cost model's predictions at the seed's shapes (~30 s of CPU)")
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(args.config) if os.path.isdir(args.config) else \
        ModelConfig.from_dict(json.load(open(args.config)))
    rows = [int(r) for r in args.rows.split(",")]
    report = run(cfg, rows, args.scale)
    print(format_table(report))
    if not args.no_cost:
        costs = cost_report(args.scale)
        for c in costs:
            print(f"ESTIMATE {c['name']} {c['shape']}: predicted {c['predicted_ms']:.3f} ms, roofline "
                  f"{c['roofline_ms']:.3f} ms, seed design predicted {c['seed_design_predicted_ms']:.3f} ms, "
                  f"seed measured {c['seed_measured_ms'] or '-'} ms")
        report = costs + report
    with open(args.json, "w") as f:
        json.dump({"assumptions": ASSUMPTIONS, "scale": args.scale, "kernels": report}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
