"""Distil the tiny V4.1 checkpoint's DSpark draft layers on the main model's own greedy continuations.

    python examples/tools/distill_tiny_drafts.py --model TINY_V41 --out TINY_V41_DISTILLED [--seed 0] \
        [--prompts 256] [--steps 300] [--threads 1]

The random tiny checkpoint's `mtp.*` layers predict nothing, so speculative decoding on it accepts
almost no draft. This trains only those layers (docs/model.md §3.8), the main model frozen:
1. the main model (this engine, greedy, up to 64 prompts at once) continues --prompts uniform random
   prompts of its own seed (never the bench's prompt generator); one more forward over each
   prompt + continuation collects the target features F (stream means at the target layers'
   attention inputs) and the main model's final normed hidden state at every position;
2. each training example is an anchor a inside a continuation: the block [t_{a+1}, noise ...] at
   positions a+1 .. a+B attends to the main keys of positions a-W+1 .. a, computed from F through
   the draft weights (so main_proj and every draft layer's wkv learn too), and is scored on
   t_{a+2} .. t_{a+B+1} with the Markov head fed the true previous token, plus the cosine distance
   of each row's normed hidden state to the main model's there (the head is shared, so that target
   is the whole next-token distribution); the confidence head learns whether the row's argmax is
   right. Block sizes alternate over --blocks, since the block is bidirectional and its length
   changes every row; Adam with a cosine-decayed learning rate;
3. the checkpoint is copied with the trained `mtp.*` tensors stored back in their own formats (fp8
   blocks, fp4 experts, bf16), so the engine loads it like the original;
4. evaluation: top-1 and hidden cosine per depth on training anchors and on continuations of
   --heldout prompts never trained on (distill_report.json).

On the random tiny model the held-out numbers are the honest ones: its greedy continuations are
uniform-looking tokens whose next token depends on the whole context, so a draft must reproduce the
main hidden state almost exactly (cosine ~0.99) to agree with its argmax, and two draft layers get to
~0.3 on unseen prompts (docs/benchmarks.md; examples/tools/probe_tiny_predictability.py measures it).

Deterministic for a seed and --threads (seeded prompts, anchors and initial state).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer, from a checkout

import torch  # noqa: E402

HIDDEN_WEIGHT = 10.0  # weight of the hidden-state cosine term against the cross-entropy


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="tiny V4.1 checkpoint (with draft layers)")
    ap.add_argument("--out", required=True, help="directory of the distilled checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=256, help="greedy continuations to train on")
    ap.add_argument("--heldout", type=int, default=16, help="continuations of unseen prompts to evaluate on")
    ap.add_argument("--eval-anchors", type=int, default=256, help="anchors per evaluation set and block size")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="anchors per step")
    ap.add_argument("--blocks", default="3,5", help="block sizes B, alternated over steps")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",")]
    if any(b < 1 for b in args.blocks) or args.steps < 0 or args.batch < 1 or args.prompts < 1 or args.heldout < 1 \
            or args.eval_anchors < 1:
        ap.error("--blocks, --batch, --prompts, --heldout, --eval-anchors must be positive and --steps >= 0")
    return args


def training_prompts(seed: int, num_prompts: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The prompts a distillation with this seed trains on (bench_spec_verify.py replays them)."""
    g = torch.Generator().manual_seed(seed)
    # Every other prompt starts with BOS (0), the rest with a random id like the bench's prompts
    # (examples/neuron/bench_lib/prompts.py): the continuations differ, and the drafts must see both.
    prompts = [torch.randint(3, min(vocab, 128000), (prompt_len,), generator=g).tolist()
               for _ in range(num_prompts)]
    for p in prompts[::2]:
        p[0] = 0
    return prompts


def greedy_continuations(llm, args, vocab: int) -> list[list[int]]:
    from deepinfer import SamplingParams
    prompts = training_prompts(args.seed, args.prompts, args.prompt_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


@torch.no_grad()
def target_features(model, worker, seqs: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per whole sequence, from one main forward (the engine's runner strategy): the target features
    F [N, D * targets] and the main model's final normed hidden state [N, D] at every position (its
    logits are head . that, and the draft rows share the head)."""
    from deepinfer.model_executor.forward_meta import SeqChunk
    blocks = list(range(1, 1 + -(-max(map(len, seqs)) // worker.block_size)))
    feats, hidden = [], []
    model.target_capture = []
    runner = worker.runner
    try:
        for s in seqs:
            model.target_capture.clear()
            chunk = SeqChunk(slot=1, ctx_len=0, num_new=len(s), block_table=blocks, token_ids=s, num_logits=len(s))
            step, _ = runner.strategy.prepare([chunk])
            hidden.append(model.hidden_states(step, runner.cache).float().clone())
            feats.append(model.target_capture[0].float().clone())
    finally:
        model.target_capture = None
    return feats, hidden


def draft_parameters(model) -> list[torch.Tensor]:
    """Every trainable tensor of the draft layers: their parameters and the stacked expert weights
    the MoE kernels read (the per-expert parameters are views of those stacks)."""
    params = []
    for blk in model.mtp:
        for name, p in blk.named_parameters():
            if ".experts." not in name:
                params.append(p)
        for name in ("_w13", "_w2"):
            stack = getattr(blk.ffn, name).detach()  # same storage: the expert views see every update
            setattr(blk.ffn, name, stack)
            params.append(stack)
    for p in params:
        p.requires_grad_(True)
    return params


def anchor_batch(seqs, prompt_len: int, b: int, n: int, gen: torch.Generator):
    """(sequence index, a) pairs: anchors inside the continuations with B + 1 known tokens after a."""
    out = []
    for _ in range(n):
        i = int(torch.randint(len(seqs), (1,), generator=gen))
        hi = len(seqs[i]) - b - 2
        a = int(torch.randint(prompt_len - 1, hi + 1, (1,), generator=gen))
        out.append((i, a))
    return out


def draft_loss(model, seqs, feats, anchors, b: int, main_hidden=None, weights=None,
               hidden_weight: float = HIDDEN_WEIGHT):
    """(loss, confidence BCE, top-1 per depth, hidden cosine per depth or None): the loss is the
    cross-entropy of the draft rows against the true continuation plus, with `main_hidden`, the
    cosine distance of their normed hidden state to the main model's at the same position times
    `hidden_weight` (the head is shared, so this matches the whole logit vector, not only its argmax;
    on unseen prompts the cosine shows how close the draft gets even where its argmax is wrong).
    `weights` (per sequence, a loss weight per token) weighs each target token's cross-entropy, and
    the top-1 then counts only the targets of the largest weight (the tokens a rule determines, in
    train_tiny's documents)."""
    from deepinfer.model_executor.forward_meta import CacheLayout
    from deepinfer.model_executor.models import dspark_draft
    from deepinfer.model_executor.models.v4_common import ModelCache
    from deepinfer.worker.cache_engine import cache_formats
    cfg = model.cfg
    w, n = cfg.sliding_window, len(anchors)
    # main keys of positions a-W+1 .. a, each anchor its own "slot" of a W-row ring
    pos = torch.tensor([a for _, a in anchors])[:, None] - (w - 1) + torch.arange(w)[None, :]
    valid = pos >= 0
    f = torch.stack([feats[i][pos[r].clamp(min=0)] for r, (i, _) in enumerate(anchors)])  # [A, W, F]
    m = dspark_draft.project_features(model, f.reshape(n * w, -1))
    cos, sin = model.rotary["main"].cos_sin(pos.clamp(min=0).reshape(-1))
    rows = (torch.arange(n)[:, None] * w + torch.remainder(pos.clamp(min=0), w)).reshape(-1)
    keep = valid.reshape(-1).nonzero().squeeze(1)
    fmts = cache_formats(cfg, "plain", torch.float32)
    swa = {}
    for blk in model.mtp:
        kappa = dspark_draft.main_key(model, blk, m, cos, sin)
        ring = torch.zeros(n * w, kappa.shape[1], dtype=kappa.dtype)
        swa[blk.layer] = ring.index_copy(0, rows[keep], kappa[keep])
    layout = CacheLayout(window=w, num_slots=n, block_size=1, compressors=[])
    block = dspark_draft.DraftBlock(slots=list(range(n)), last_pos=[a for _, a in anchors],
                                    first_tokens=[seqs[i][a + 1] for i, a in anchors], block=b)
    step = dspark_draft.draft_step_inputs(block, layout, cfg.dspark_noise_token_id)
    hidden, base = dspark_draft.draft_forward(model, step, ModelCache(swa=swa, formats=fmts))
    prev = torch.tensor([seqs[i][a + 1 + k] for i, a in anchors for k in range(b)])
    target = torch.tensor([seqs[i][a + 2 + k] for i, a in anchors for k in range(b)])
    pe = dspark_draft.markov_embed(model, prev)
    logits = base + dspark_draft.markov_logits(model, pe)
    if weights is None:
        ce = torch.nn.functional.cross_entropy(logits, target)
        counted = torch.ones(n * b)
    else:
        w = torch.tensor([float(weights[i][a + 2 + k]) for i, a in anchors for k in range(b)])
        ce = (torch.nn.functional.cross_entropy(logits, target, reduction="none") * w).sum() / w.sum()
        counted = (w == w.max()).float()
    cos = None
    if main_hidden is not None:
        # row k sits at position a+1+k, where the main model's own normed hidden state predicts a+2+k
        want = torch.stack([main_hidden[i][a + 1 + k] for i, a in anchors for k in range(b)])
        got = model.kernels.rms_norm(hidden, model.mtp[-1].norm.weight, cfg.rms_norm_eps)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        ce = ce + hidden_weight * (1 - cos).mean()
        cos = cos.detach().view(n, b).mean(dim=0)
    right = (logits.argmax(dim=-1) == target).float()
    conf = dspark_draft.confidence(model, hidden, pe)
    bce = torch.nn.functional.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), right)
    top1 = (right * counted).view(n, b).sum(dim=0) / counted.view(n, b).sum(dim=0).clamp(min=1)
    return ce, bce, top1, cos


def write_checkpoint(src: str, dst: str, model) -> int:
    """Copy `src` to `dst` with every mtp.* tensor replaced by the model's, in the stored format."""
    from safetensors.torch import load_file, save_file

    from deepinfer.model_executor.checkpoint_schema import tensor_format
    from deepinfer.model_executor.tiny_checkpoint import stored_tensors
    cfg = model.cfg
    if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copytree(src, dst, dirs_exist_ok=True)
    quantized = cfg.quant is not None
    block = tuple(cfg.quant["weight_block_size"]) if quantized else (128, 128)
    state = {k: v.detach().float() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    written = 0
    for shard in sorted(f for f in os.listdir(dst) if f.endswith(".safetensors")):
        path = os.path.join(dst, shard)
        tensors = load_file(path)
        for name in [k for k in tensors if k.startswith("mtp.") and k in state]:
            stored = stored_tensors(cfg, name, state[name], tensor_format(cfg, name, quantized),
                                    torch.float32, block)
            for k, v in stored.items():
                assert k in tensors, f"{k}: not in {shard}"
                tensors[k] = v.contiguous()
            written += 1
        save_file(tensors, path, metadata={"format": "pt"})
    return written


@contextlib.contextmanager
def fp32_vocab_heads():
    """Engines built inside keep their vocabulary heads fp32 only: training writes those weights in
    place, so the cpu platform's bf16 copies of them (layers/head_gemm.py, DEEPINFER_CPU_BF16_HEAD)
    would go stale."""
    before = os.environ.get("DEEPINFER_CPU_BF16_HEAD")
    os.environ["DEEPINFER_CPU_BF16_HEAD"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DEEPINFER_CPU_BF16_HEAD"]
        else:
            os.environ["DEEPINFER_CPU_BF16_HEAD"] = before


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from deepinfer import LLM
    t0 = time.perf_counter()
    with fp32_vocab_heads():
        llm = LLM(model=args.model, dtype="float32", max_model_len=args.prompt_len + args.gen_len + 8,
                  max_num_seqs=min(max(args.prompts, args.heldout), 64), weight_format="dense", enforce_eager=True)
    engine = llm.llm_engine
    model, cfg = engine.worker.model, engine.model_config
    if not cfg.is_v41 or not cfg.num_nextn_predict_layers:
        print("error: --model needs a deepseek_v41 checkpoint with draft layers", file=sys.stderr)
        return 2
    seqs = greedy_continuations(llm, args, cfg.vocab_size)
    feats, main_hidden = target_features(model, engine.worker, seqs)
    t_data = time.perf_counter() - t0
    print(f"data: {len(seqs)} greedy continuations of {args.gen_len} tokens in {t_data:.1f} s", flush=True)

    params = draft_parameters(model)
    opt = torch.optim.Adam(params, lr=args.lr)
    # cosine decay to 0: late steps refine instead of hopping between memorised anchors
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))
    gen = torch.Generator().manual_seed(args.seed + 1)
    hold = torch.Generator().manual_seed(args.seed + 2)
    history = []
    t1 = time.perf_counter()
    for it in range(args.steps):
        b = args.blocks[it % len(args.blocks)]
        ce, bce, acc, cos = draft_loss(model, seqs, feats, anchor_batch(seqs, args.prompt_len, b, args.batch, gen),
                                       b, main_hidden)
        opt.zero_grad(set_to_none=True)
        (ce + 0.1 * bce).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if it % 25 == 0 or it == args.steps - 1:
            history.append({"step": it, "block": b, "loss": float(ce.detach()), "bce": float(bce.detach()),
                            "top1_per_depth": acc.tolist(), "hidden_cos_per_depth": cos.tolist()})
            print(f"step {it:4d} B={b} loss {history[-1]['loss']:.3f} conf-bce {history[-1]['bce']:.3f} "
                  f"top-1 per depth {' '.join(f'{x:.2f}' for x in acc.tolist())} "
                  f"hidden cos {' '.join(f'{x:.2f}' for x in cos.tolist())}", flush=True)
    t_train = time.perf_counter() - t1
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        # held-out: continuations of prompts never trained on (what the bench sees), and the training set
        fresh_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 7919, "prompts": args.heldout})
        fresh = greedy_continuations(llm, fresh_args, cfg.vocab_size)
        fresh_feats, fresh_hidden = target_features(model, engine.worker, fresh)
        evals, held = {}, {}
        for b in args.blocks:
            for name, data, out in (("train", (seqs, feats, main_hidden), evals),
                                    ("held-out", (fresh, fresh_feats, fresh_hidden), held)):
                _, _, acc, cos = draft_loss(model, data[0], data[1],
                                            anchor_batch(data[0], args.prompt_len, b, args.eval_anchors, hold), b, data[2])
                out[b] = {"top1_per_depth": acc.tolist(), "hidden_cos_per_depth": cos.tolist()}
    n = write_checkpoint(args.model, args.out, model)
    report = {"seed": args.seed, "data_s": t_data, "train_s": t_train, "steps": args.steps,
              "prompts": args.prompts, "heldout_prompts": args.heldout, "gen_len": args.gen_len,
              "tensors_written": n, "train_by_block": evals, "heldout_by_block": held, "history": history}
    with open(os.path.join(args.out, "distill_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"trained {args.steps} steps in {t_train:.1f} s; wrote {n} mtp tensors to {args.out}")
    for name, res in (("training set", evals), ("held-out prompts", held)):
        for b, r in res.items():
            print(f"{name} B={b}: top-1 per depth {' '.join(f'{x:.2f}' for x in r['top1_per_depth'])}, "
                  f"hidden cos per depth {' '.join(f'{x:.3f}' for x in r['hidden_cos_per_depth'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
