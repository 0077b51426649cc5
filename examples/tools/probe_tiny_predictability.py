"""How predictable is the tiny V4.1's next token? The numbers that decide what a distilled draft can learn.

    python examples/tools/probe_tiny_predictability.py --model TINY_V41 [--seed 123] [--threads 2] [--out probe.json]

On the random tiny checkpoint (examples/tools/make_tiny_checkpoint.py) the main model is frozen
noise, so before distilling its draft layers (distill_tiny_drafts.py) this measures, on uniform
random prompts of its own seed (never the bench's prompt generator):
1. structure of the greedy continuations: distinct tokens, repeats at lags 1-8, periodic tails,
   and whether a token -> next-token table built on half the continuations predicts the other half;
2. context dependence: how often the main model's argmax at position p changes when the single
   token at p - d is replaced (d = 0 is the current token), and the cosine of its final hidden state;
3. precision needed: the top-1 kept when the final normed hidden state is rotated to cosine c of
   itself (the head is shared with the draft, so a draft must reach that cosine to agree);
4. a linear ceiling: ridge regression from what a draft row 0 sees (the target features F at a and
   a - 1 and the embedding of x0 = t_{a+1}) to the main hidden state at a + 1, held-out cosine and top-1.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

import distill_tiny_drafts as distill  # noqa: E402


def continuation_stats(prompts, conts) -> dict:
    flat = [t for c in conts for t in c]
    lag = {d: sum(c[i] == c[i - d] for c in conts for i in range(d, len(c))) / sum(len(c) - d for c in conts)
           for d in (1, 2, 3, 4, 8)}
    periodic = sum(any(all(c[-1 - k] == c[-1 - k - p] for k in range(12))
                       for p in range(1, min(20, len(c) - 11))) for c in conts)
    half = len(conts) // 2
    table = collections.defaultdict(collections.Counter)
    for p, c in zip(prompts[:half], conts[:half]):
        s = [p[-1]] + c
        for x, y in zip(s, s[1:]):
            table[x][y] += 1
    seen = hit = n = 0
    for p, c in zip(prompts[half:], conts[half:]):
        s = [p[-1]] + c
        for x, y in zip(s, s[1:]):
            n += 1
            if x in table:
                seen += 1
                hit += table[x].most_common(1)[0][0] == y
    return {"tokens": len(flat), "distinct": len(set(flat)), "repeat_at_lag": lag,
            "periodic_tails": periodic, "continuations": len(conts),
            "bigram_heldout_coverage": seen / n, "bigram_heldout_top1": hit / n}


def argmax(model, h):
    return torch.cat([model.compute_logits(h[i:i + 1024]).float().argmax(-1) for i in range(0, len(h), 1024)])


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--ridge-seqs", type=int, default=256, help="random sequences for the linear ceiling")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from deepinfer import LLM
    length = 64
    llm = LLM(model=args.model, dtype="float32", max_model_len=max(16 + args.gen_len, length) + 8,
              max_num_seqs=64, weight_format="dense", enforce_eager=True)
    worker = llm.llm_engine.worker
    model = worker.model
    g = torch.Generator().manual_seed(args.seed)
    gen_args = argparse.Namespace(seed=args.seed, prompts=args.prompts, prompt_len=16, gen_len=args.gen_len)
    seqs = distill.greedy_continuations(llm, gen_args, model.cfg.vocab_size)
    report = {"continuations": continuation_stats([s[:16] for s in seqs], [s[16:] for s in seqs])}

    rand = [torch.randint(3, 128000, (length,), generator=g).tolist() for _ in range(args.ridge_seqs)]
    feats, hidden = distill.target_features(model, worker, rand)
    p, base = 48, rand[:16]
    ref_h = torch.stack([h[p] for h in hidden[:16]])
    ref = argmax(model, ref_h)
    report["perturb_token_at_distance"] = {}
    for d in (0, 1, 2, 4, 8, 16, 32, 47):
        alt = [list(s) for s in base]
        for s in alt:
            s[p - d] = int(torch.randint(3, 128000, (1,), generator=g))
        _, h2 = distill.target_features(model, worker, alt)
        h2 = torch.stack([h[p] for h in h2])
        report["perturb_token_at_distance"][d] = {
            "argmax_changed": float((argmax(model, h2) != ref).float().mean()),
            "hidden_cos": float(torch.nn.functional.cosine_similarity(h2, ref_h, dim=-1).mean())}

    h = torch.cat(hidden)[:1024]
    top = argmax(model, h)
    report["top1_kept_at_hidden_cos"] = {}
    for c in (0.999, 0.99, 0.98, 0.95, 0.9):
        z = torch.randn(h.shape, generator=g)
        z = z - (z * h).sum(-1, keepdim=True) / (h * h).sum(-1, keepdim=True) * h
        z = z / z.norm(dim=-1, keepdim=True) * h.norm(dim=-1, keepdim=True)
        report["top1_kept_at_hidden_cos"][c] = float((argmax(model, h + (1 - c * c) ** 0.5 / c * z) == top).float().mean())

    emb = model.embed.weight.float()
    a = torch.arange(8, length - 1)
    x = torch.cat([torch.cat([f[a], f[a - 1], emb[torch.tensor(s)[a + 1]]], -1) for s, f in zip(rand, feats)])
    y = torch.cat([hh[a + 1] for hh in hidden])
    ntr = int(0.85 * len(x))
    report["ridge_to_next_hidden"] = {}
    for name, cols in (("x0 embedding", slice(2 * feats[0].shape[1], None)), ("F[a]", slice(0, feats[0].shape[1])),
                       ("F[a], F[a-1], x0 embedding", slice(0, None))):
        xs = x[:, cols]
        xs = (xs - xs[:ntr].mean(0)) / (xs[:ntr].std(0) + 1e-6)
        xs = torch.cat([xs, torch.ones(len(xs), 1)], 1)
        w = torch.linalg.solve(xs[:ntr].T @ xs[:ntr] + 10 * torch.eye(xs.shape[1]), xs[:ntr].T @ y[:ntr])
        pred = xs[ntr:] @ w
        report["ridge_to_next_hidden"][name] = {
            "train_positions": ntr,
            "train_cos": float(torch.nn.functional.cosine_similarity(xs[:ntr] @ w, y[:ntr], dim=-1).mean()),
            "heldout_cos": float(torch.nn.functional.cosine_similarity(pred, y[ntr:], dim=-1).mean()),
            "heldout_top1": float((argmax(model, pred) == argmax(model, y[ntr:])).float().mean())}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
