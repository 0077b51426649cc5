"""Golden numbers: deepinfer vs transformers on the tiny V4 checkpoint, and V4.1 self-consistency.

    python examples/tools/golden_report.py --v4 DIR_V4_UNQUANTIZED --v41 DIR_V41 [--out golden.json]

V4: per prompt length, max |logit difference| and min cosine per position against transformers'
DeepseekV4ForCausalLM (fp32, same files), argmax agreement, and for prefill / token-by-token decode /
chunked prefill. V4.1: prefill vs decode vs chunked logits (index_topk and candidate blocks covering
every entry), and the sparse (checkpoint) setting's chunked-vs-prefill argmax agreement.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.worker.worker import build_model  # noqa: E402
from tests.support.model_helpers import run_chunks  # noqa: E402


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 128000, (n - 1,), generator=g).tolist()


def _cmp(a, b):
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"max_abs_diff": (a - b).abs().max().item(), "min_cos": cos.min().item(),
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v4", required=True)
    ap.add_argument("--v41", required=True)
    ap.add_argument("--out", default="results/golden.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    out = {"v4": {}, "v41": {}}
    tf = AutoModelForCausalLM.from_pretrained(args.v4, dtype=torch.float32).eval()
    cfg = ModelConfig.from_pretrained(args.v4)
    ours = build_model(cfg, args.v4, torch.float32, progress=False)
    for n in (40, 100, 259):
        ids = _ids(n, n)
        with torch.no_grad():
            ref = tf(torch.tensor([ids])).logits[0].float()
        rec = {"prefill": _cmp(run_chunks(ours, ids, [n]), ref),
               "decode": _cmp(run_chunks(ours, ids, [1] * n), ref),
               "chunked": _cmp(run_chunks(ours, ids, [n // 3, 1, n - n // 3 - 1]), ref)}
        out["v4"][n] = rec
        print(f"V4 vs transformers, {n:3d} tokens: " + "; ".join(
            f"{k} max|d| {v['max_abs_diff']:.2e} min cos {v['min_cos']:.6f} argmax {v['argmax_agree']:.3f}"
            for k, v in rec.items()))
    cfg41 = ModelConfig.from_pretrained(args.v41)
    wide = dataclasses.replace(cfg41, index_topk=512, candidate_topk_blocks=64)
    m = build_model(wide, args.v41, torch.float32, progress=False)
    ids = _ids(120, 3)
    full = run_chunks(m, ids, [120])
    rec = {"decode_vs_prefill": _cmp(run_chunks(m, ids, [1] * 120), full),
           "chunked_vs_prefill": _cmp(run_chunks(m, ids, [7, 1, 1, 50, 61]), full)}
    sparse = build_model(cfg41, args.v41, torch.float32, progress=False)
    sp = run_chunks(sparse, ids, [120])
    rec["sparse_chunked_vs_prefill"] = _cmp(run_chunks(sparse, ids, [60, 1, 59]), sp)
    out["v41"] = rec
    for k, v in rec.items():
        print(f"V4.1 {k}: max|d| {v['max_abs_diff']:.2e} min cos {v['min_cos']:.6f} argmax {v['argmax_agree']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(out, open(args.out, "w"), indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
