"""Train a tiny DeepSeek V4.1 or V4 on the synthetic language (docs/tiny_language.md) and write it
in the real checkpoint layout.

    python examples/train_tiny.py --kind v41 --out checkpoints/trained-v41 [--seed 0] [--steps N]
        [--artifact examples/artifacts/trained-v41.safetensors]
    python examples/train_tiny.py --kind v41 --main-from checkpoints/trained-v41 --out DIR2 \
        --draft-steps 1200 [--draft-docs N] [--artifact FILE]     # more draft distillation only

What it does (docs/tiny_language.md, "Training"):
1. writes a random checkpoint of the training config (model_executor/tiny_checkpoint.py values)
   and loads it in this engine (fp32, dense weights, plain KV, eager);
2. trains every weight through the engine's own forward (`DeepseekV4Model.hidden_states` on
   prefill steps the runner builds, autograd on), on documents of the language;
   the embedding and LM head are trained only on the rows of the tokens the language uses plus one
   shared row for every other token, whose logit carries log(#other tokens): with all other rows
   equal, that softmax over U + 1 classes is exactly the full-vocabulary softmax;
3. (V4.1) distils the DSpark draft layers on the trained main model
   (examples/tools/distill_tiny_drafts.py's loss, on the language's documents);
4. quantizes once (fp8 blocks, fp4 experts, fp8 Engram tables, bf16 embedding / head) and writes
   the checkpoint, plus optionally the compact artifact (examples/tools/trained_artifact.py):
   the stored tensors with only the language's vocabulary rows, which expands back to the same
   checkpoint byte for byte.

Deterministic for a seed and --threads.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))      # deepinfer, from a checkout
sys.path.insert(0, _HERE)                       # tiny_language

import torch  # noqa: E402

import tiny_language as lang  # noqa: E402

def _tool(name: str):
    """A module of examples/tools (distill_tiny_drafts, trained_artifact), imported on first use."""
    tools = os.path.join(_HERE, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


BOS = 0  # the engine starts every text prompt with BOS (deepinfer/tokenizer.py), so documents do too


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------

def training_config(kind: str) -> dict:
    """The training configs: smaller than the tiny ones of model_executor/tiny_checkpoint.py, with
    the same features.

    V4.1, six layers, ratios [0, 2, 2, 1, 1, 1]: layer 1 is a C2 kv + index source, layer 2 shares
    its compressed cache and index keys but runs its own indexer; layer 3 (n_prefill_layer, the
    YOCO boundary) is a C1 kv source and the candidate source, layer 4 shares its cache and its
    selection, layer 5 is a YOCO consumer kv source (it compresses the shared hidden) and a
    candidate consumer; Engram on layers 1 and 3 (tables from 503 rows), mHC with 6 Sinkhorn
    iterations, 8 experts of width 64, top-2,
    two DSpark draft layers on targets 1, 3, 5. V4: the tiny V4's six layers (SWA, CSA, HCA, ...,
    hash-routed first layers).

    Window 32 and index top-k 128 (candidate capacity 16 blocks of 8): every short line of the
    language (at most ~140 tokens) is seen whole by every compressed layer, so the short kinds need
    no trained indexer; long lookup is where the indexer has to choose.
    """
    from deepinfer.model_executor.tiny_checkpoint import v4_tiny_config, v41_tiny_config
    if kind == "v41":
        raw = v41_tiny_config(layers=8, index_topk=128)
        text = raw["text_config"]
        text.update({
            "num_hidden_layers": 6, "compress_ratios": [0, 2, 2, 1, 1, 1] + [0, 0],
            "kv_source_layer_ids": [1, 3, 5], "index_source_layer_ids": [1, 2, 3, 5],
            "candidate_source_layer_id": 3, "candidate_topk_blocks": 16, "candidate_block_size": 8,
            "engram_layer_ids": [1, 3], "dspark_target_layer_ids": [1, 3, 5],
            "sliding_window": 32, "hc_sinkhorn_iters": 6, "max_position_embeddings": 8192,
            "moe_intermediate_size": 64, "engram_vocab_size": 503})
    elif kind == "v4":
        raw = v4_tiny_config(layers=6, index_topk=128, quantized=True)
        raw.update({"sliding_window": 32, "hc_sinkhorn_iters": 6, "max_position_embeddings": 8192,
                    "moe_intermediate_size": 64})
    else:
        raise ValueError(f"kind must be v41 or v4, got {kind!r}")
    return raw


# ---------------------------------------------------------------------------------------------
# the language's vocabulary
# ---------------------------------------------------------------------------------------------

def load_tokenizer():
    from deepinfer.model_executor.tiny_checkpoint import _tokenizer_dir
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(_tokenizer_dir() / "tokenizer.json"))


def language_token_ids(tok) -> list[int]:
    """Every token id the language can produce, sorted: numbers up to the largest count, keys in
    both widths, words after a space and after `=`, and the punctuation of each kind."""
    ids = {BOS}
    texts = ["count: 1 2\n", "count by 3: 3 6\n", "copy: river = river\n", "keys: k00=river ; k00 -> river\n"]
    texts += [" ".join(str(i) for i in range(0, 1100))]   # counts stay below 999 + 9 * 11
    texts += [" ".join(f"k{i:02d}" for i in range(100)), " ".join(f"k{i:03d}" for i in range(1000))]
    texts += [" ".join(f"k{i:02d}={w}" for i, w in enumerate(lang.WORDS))]
    texts += [" ".join(f"k{i:03d}={w}" for i, w in enumerate(lang.WORDS))]
    texts += [" " + " ".join(lang.WORDS) + "\n"]
    rng = random.Random(0)
    texts += [lang.document(rng, 200, lang.KINDS[:3])]
    for t in texts:
        ids.update(tok.encode(t).ids)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

# Line kinds of the training documents and their shares: a lookup line is ~70 tokens for one
# determined answer token, a count or copy line ~20 tokens of which about half are determined, so
# lookups get a small share of the lines (their tokens are still a large share of the tokens).
# Copy gets half the lines: the copy (induction) heads form only after enough copied words have
# been seen (on copy-only data the copied-word accuracy left chance after ~130 steps of 4 x 64
# tokens at lr 2e-3, and stayed at chance through 650 steps at 35 % copy lines and lr 5e-3).
TRAIN_KINDS = ("count", "copy", "lookup")
FREE_WEIGHT = 0.1   # loss weight of tokens the rules do not determine (random words, starts, keys)


@dataclass(frozen=True)
class DataMix:
    """What the training documents hold: the line kinds' shares, how many of the lookups are short
    (at most `short_lookup_pairs` pairs, so a step holds more lookup answers for the same tokens; the
    language's prompts keep 4-32), and the loss weight of a lookup's answer (one determined token a
    line, against about ten in a copy line)."""
    shares: tuple[float, float, float] = (0.30, 0.50, 0.20)
    short_lookup_pairs: int = 12
    short_lookup_share: float = 0.5
    lookup_weight: float = 1.0
    short_lookup_least: int = 4


def line_parts(rng: random.Random, kind: str, mix: DataMix = DataMix()) -> tuple[str, str]:
    """(free part, determined part) of one line: what a rule fixes is the count after its second
    number, the copy after ` =`, the lookup's value after ` ->` (with the newline)."""
    if kind == "lookup" and rng.random() < mix.short_lookup_share:
        head, value = lang.lookup_parts(rng, False, mix.short_lookup_pairs, mix.short_lookup_least)
        text = f"{head} {value}\n"
    else:
        text = lang.line(rng, kind)
    if kind == "count":
        head, nums = text.split(": ", 1)
        nums = nums.split(" ")
        return f"{head}: {nums[0]} {nums[1]}", " " + " ".join(nums[2:])
    cut = text.index(" =") + 2 if kind == "copy" else text.index(" ->") + 3
    return text[:cut], text[cut:]


def training_batch(tok, rng: random.Random, batch: int, seq_len: int, kinds_out: list | None = None,
                   mix: DataMix = DataMix()) -> list[tuple[list[int], list[float]]]:
    """`batch` documents of whole lines after BOS, each cut to `seq_len` + 1 tokens (a document
    starts at a line start, as the prompts do), with each token's loss weight: 1 where the rules
    determine the token (`mix.lookup_weight` for a lookup's answer), FREE_WEIGHT elsewhere."""
    out = []
    for _ in range(batch):
        ids: list[int] = [BOS]
        weights: list[float] = [FREE_WEIGHT]
        kinds = [-1]
        while len(ids) < seq_len + 1:
            kind = rng.choices(TRAIN_KINDS, mix.shares)[0]
            free, fixed = line_parts(rng, kind, mix)
            a, b = tok.encode(free).ids, tok.encode(fixed).ids
            ids += a + b
            determined = mix.lookup_weight if kind == "lookup" else 1.0
            weights += [FREE_WEIGHT] * len(a) + [determined] * len(b)
            kinds += [-1] * len(a) + [TRAIN_KINDS.index(kind)] * len(b)
        out.append((ids[: seq_len + 1], weights[: seq_len + 1]))
        if kinds_out is not None:
            kinds_out.append(kinds[: seq_len + 1])
    return out


# ---------------------------------------------------------------------------------------------
# the training forward: the engine's model and runner, autograd on
# ---------------------------------------------------------------------------------------------

class CompactRows:
    """Stands in for `embed.weight` during training: `rows[ids]` reads the trained row of each
    language token (every other token shares one row)."""

    def __init__(self, small: torch.Tensor, remap: torch.Tensor):
        self.small, self.remap = small, remap

    def __getitem__(self, ids):
        return self.small[self.remap[ids]]


def trainable_parameters(model) -> list[torch.Tensor]:
    """Every weight of the main model and its draft layers but the embedding and head (trained as
    compact rows) and the per-expert views of the stacked expert weights (the stacks train)."""
    params = []
    for name, p in model.named_parameters():
        if name in ("embed.weight", "head.weight") or ".experts." in name:
            continue
        params.append(p)
    blocks = list(model.layers) + list(getattr(model, "mtp", []))
    for blk in blocks:
        for name in ("_w13", "_w2"):
            stack = getattr(blk.ffn, name).detach()   # same storage: the expert views see every update
            setattr(blk.ffn, name, stack)
            params.append(stack)
    for p in params:
        p.requires_grad_(p.dtype.is_floating_point)
    return [p for p in params if p.dtype.is_floating_point]


def detach_cache(cache) -> None:
    """Cut the autograd history each step's cache writes leave on the cache tensors."""
    for store in (cache.swa, cache.comp_state, cache.entries, cache.index_keys):
        for key, t in list(store.items()):
            store[key] = t.detach()


def step_hidden(model, worker, seqs: list[list[int]]) -> torch.Tensor:
    """Final normed hidden states of every position of each sequence, one prefill step, each
    sequence in its own slot (the runner's step builder)."""
    from deepinfer.model_executor.forward_meta import SeqChunk
    runner = worker.runner
    per_seq = -(-max(map(len, seqs)) // worker.block_size)
    chunks = [SeqChunk(slot=1 + i, ctx_len=0, num_new=len(s), block_table=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
                       token_ids=s, num_logits=len(s)) for i, s in enumerate(seqs)]
    step, _ = runner.strategy.prepare(chunks)
    detach_cache(runner.cache)
    return model.hidden_states(step, runner.cache)


def word_vectors(dim: int, seed: int) -> dict[str, torch.Tensor]:
    """A random unit-rms vector per word of the language's list, from its own seeded stream, so the
    embedding's and the head's initial rows (number_features) share them."""
    g = torch.Generator().manual_seed(seed + 7919)
    return {w: torch.randn(dim, generator=g) for w in lang.WORDS}


def number_features(tok, used: list[int], dim: int, gen: torch.Generator,
                    words: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Initial rows [U + 1, dim] of the compact embedding: a random row per token, and for a token
    that is a number (with or without leading zeros) sines and cosines of its value in the first
    dimensions, so "the next number" starts out as a rotation the layers can learn to apply
    (counting would otherwise have to learn 1,000 unrelated successors from a few thousand lines).
    With `words` (word_vectors), a token that is a whole word of the list, with or without its
    leading space, starts as that word's vector plus a smaller random part: a lookup's value is
    written bare after `=` (`k03=river`) but answered with the space (` river`), and a head that
    copies the bare token's features then already points at the spaced one."""
    rows = torch.randn(len(used) + 1, dim, generator=gen)
    periods = torch.tensor([2.0, 3, 4, 5, 7, 9, 10, 16, 25, 40, 64, 100, 160, 250, 400, 1000])
    for r, tid in enumerate(used):
        text = tok.id_to_token(tid).lstrip("\u0120")
        if text.isdigit():
            ang = 2 * math.pi * int(text) / periods
            feats = torch.cat([ang.sin(), ang.cos(), torch.tensor([float(len(text)), float(text[0] == "0")])])
            # the value features dominate the row (a smaller random part), so the rms-normed
            # input of every layer carries the number's value clearly
            rows[r] *= 0.5
            rows[r, : feats.numel()] = 4.0 * feats
        elif words is not None and text in words:
            rows[r] = 0.5 * rows[r] + words[text]
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("v41", "v4"), required=True)
    ap.add_argument("--out", required=True, help="directory of the trained checkpoint")
    ap.add_argument("--artifact", default=None, help="also write the compact artifact here (a .safetensors path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--shares", default="0.30,0.50,0.20",
                    help="shares of count, copy and lookup lines in the training documents")
    ap.add_argument("--short-lookup-pairs", type=int, default=12,
                    help="a short training lookup has --short-lookup-least to this many pairs")
    ap.add_argument("--short-lookup-least", type=int, default=4,
                    help="a short training lookup has at least this many pairs (the language's have 4)")
    ap.add_argument("--short-lookup-share", type=float, default=0.5, help="share of the lookups that are short")
    ap.add_argument("--lookup-weight", type=float, default=1.0, help="loss weight of a lookup's answer tokens")
    # the second phase starts once the copy heads have formed (near step 340 with the first mix) and
    # keeps count and copy lines while adding short lookups (docs/tiny_language.md §6: run D)
    ap.add_argument("--phase2-from", type=int, default=450,
                    help="from this training step on, draw documents with the --phase2-* mix (-1: never)")
    ap.add_argument("--phase2-shares", default="0.30,0.35,0.35")
    ap.add_argument("--phase2-short-lookup-pairs", type=int, default=6)
    ap.add_argument("--phase2-short-lookup-least", type=int, default=4)
    ap.add_argument("--phase2-short-lookup-share", type=float, default=0.8)
    ap.add_argument("--phase2-lookup-weight", type=float, default=3.0)
    ap.add_argument("--draft-steps", type=int, default=30)
    ap.add_argument("--draft-batch", type=int, default=24)
    ap.add_argument("--draft-docs", type=int, default=48,
                    help="documents of 96 tokens the draft distillation draws its anchors from")
    ap.add_argument("--word-features", action=argparse.BooleanOptionalAction, default=False,
                    help="start a word's bare and spaced tokens from one shared vector (number_features)")
    ap.add_argument("--draft-hidden-weight", type=float, default=10.0,
                    help="weight of the draft rows' hidden-state cosine to the main model's in the loss")
    ap.add_argument("--main-from", default=None,
                    help="a checkpoint this script wrote (same --kind): load its main model and skip its "
                         "training (--steps is ignored), then distil the draft layers on it")
    ap.add_argument("--init-from", default=None,
                    help="a checkpoint this script wrote (same --kind): train its main model further "
                         "instead of starting from the seed's initial weights")
    # one thread: on a shared, loaded machine two OpenMP threads wait on each other (small ops ran
    # 15-80x slower with 2 threads than with 1 at a load of 10 on 2 cores, measured)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def data_mixes(args) -> tuple[DataMix, DataMix]:
    """(the --shares / --short-lookup-* / --lookup-weight mix, the --phase2-* one), both checked."""
    def mix(pre: str) -> DataMix:
        text = getattr(args, pre + "shares")
        shares = tuple(float(x) for x in text.split(","))
        if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
            raise SystemExit(f"shares take three non-negative numbers (count, copy, lookup), got {text!r}")
        least, most = getattr(args, pre + "short_lookup_least"), getattr(args, pre + "short_lookup_pairs")
        if not 1 <= least <= most:
            raise SystemExit(f"short lookups need 1 <= least <= most pairs, got {least} and {most}")
        return DataMix(shares, most, getattr(args, pre + "short_lookup_share"),
                       getattr(args, pre + "lookup_weight"), least)
    return mix(""), mix("phase2_")


def data_mix(args, step: int, mixes: tuple[DataMix, DataMix] | None = None) -> DataMix:
    """The documents' mix at training step `step`: the first of `mixes` (default data_mixes(args)),
    and from --phase2-from on the second (a second phase once copying has formed)."""
    first, second = mixes or data_mixes(args)
    return second if 0 <= args.phase2_from <= step else first


def train_main(model, worker, tok, used, args, log) -> tuple[torch.Tensor, torch.Tensor]:
    """Train the main model; returns the trained compact (embed rows, head rows), U + 1 each."""
    cfg = model.cfg
    vocab, dim = cfg.vocab_size, cfg.hidden_size
    remap = torch.full((vocab,), len(used), dtype=torch.long)
    remap[torch.tensor(used)] = torch.arange(len(used))
    g = torch.Generator().manual_seed(args.seed)
    words = word_vectors(dim, args.seed) if args.word_features else None
    if args.init_from:
        # the loaded checkpoint's rows: every token outside the language holds its shared last row
        rest = int((remap == len(used)).nonzero()[0])
        rows = torch.tensor(used + [rest])
        embed_rows = torch.nn.Parameter(model.embed.weight.detach()[rows].float().clone())
        head_rows = torch.nn.Parameter(model.head.weight.detach()[rows].float().clone())
    else:
        embed_rows = torch.nn.Parameter(number_features(tok, used, dim, g, words))
        head_rows = torch.nn.Parameter(number_features(tok, used, dim, g, words) / math.sqrt(dim))
    real_embed = model.embed
    model.embed = torch.nn.Module()
    model.embed.weight = CompactRows(embed_rows, remap)
    # every token outside the language shares the last row; its logit counts all of them
    rest_bias = torch.zeros(len(used) + 1)
    rest_bias[-1] = math.log(vocab - len(used))
    params = trainable_parameters(model) + [embed_rows, head_rows]
    log(f"{len(used)} language tokens; {sum(p.numel() for p in params) / 1e6:.2f} M trained values")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1), pct_start=0.05)
    rng = random.Random(f"train/{args.seed}")
    mixes = data_mixes(args)   # both checked before the first step, not when the second phase starts
    t1, c1 = time.perf_counter(), time.process_time()
    try:
        for it in range(args.steps):
            kinds: list = []
            batch = training_batch(tok, rng, args.batch, args.seq_len, kinds, data_mix(args, it, mixes))
            kind = torch.tensor([k[1:] for k in kinds]).reshape(-1)
            target = remap[torch.tensor([s[1:] for s, _ in batch]).reshape(-1)]
            weight = torch.tensor([w[1:] for _, w in batch]).reshape(-1)
            h = step_hidden(model, worker, [s[:-1] for s, _ in batch])
            logits = h @ head_rows.t() + rest_bias
            loss = (torch.nn.functional.cross_entropy(logits, target, reduction="none") * weight).sum() / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if it % 20 == 0 or it == args.steps - 1:
                hit = logits.detach().argmax(-1) == target
                acc = " ".join(f"{name} {float(hit[kind == i].float().mean()):.2f}" for i, name in enumerate(TRAIN_KINDS))
                log(f"step {it:4d} loss {float(loss.detach()):.3f} determined-token acc {acc} "
                    f"{time.perf_counter() - t1:.0f} s wall, {time.process_time() - c1:.0f} s cpu")
    finally:
        model.embed = real_embed
        for p in params:
            p.requires_grad_(False)
    with torch.no_grad():
        model.embed.weight.copy_(embed_rows.detach()[remap])
        model.head.weight.copy_(head_rows.detach()[remap])
    return embed_rows.detach(), head_rows.detach()


def determined_anchors(seqs, weights, b: int, n: int, gen: torch.Generator, free_share: float = 0.2):
    """`n` (document, a) anchors of draft blocks of `b` rows: a block starts at a + 1 and is scored on
    a + 2 .. a + b + 1. A uniform candidate is kept when its first scored token is one the rules
    determine, else with probability `free_share` (a free token, a random word or key, has no right
    draft, and lookup lines are mostly free tokens): on the training documents about 70 % of the
    anchors then start on a determined token, against about 30 % of uniform ones."""
    uniform = _tool("distill_tiny_drafts").anchor_batch
    out = []
    while len(out) < n:
        (i, a), = uniform(seqs, 1, b, 1, gen)
        if weights[i][a + 2] > FREE_WEIGHT or float(torch.rand((), generator=gen)) < free_share:
            out.append((i, a))
    return out


def distill_drafts(model, worker, tok, used, args, log) -> None:
    """Train the DSpark draft layers on the trained main model (the main model frozen), with
    examples/tools/distill_tiny_drafts.py's loss on documents of the language. The Markov head's
    rows of tokens outside the language keep their initial values (their gradient is cut), so the
    compact artifact can regenerate them from the seed."""
    distill = _tool("distill_tiny_drafts")
    cfg = model.cfg
    rng = random.Random(f"drafts/{args.seed}")
    docs = training_batch(tok, rng, args.draft_docs, 96)
    seqs, weights = [ids for ids, _ in docs], [w for _, w in docs]
    with torch.no_grad():
        feats, hidden = distill.target_features(model, worker, seqs)
    params = distill.draft_parameters(model)
    keep = torch.zeros(cfg.vocab_size, 1)
    keep[torch.tensor(used)] = 1.0
    mh = model.mtp[-1].markov_head
    for t in (mh.embed.weight, mh.head.weight):
        t.register_hook(lambda grad: grad * keep.to(grad.dtype))
    opt = torch.optim.Adam(params, lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.draft_steps, 1))
    gen = torch.Generator().manual_seed(args.seed + 1)
    blocks = [3, 5]
    t1 = time.perf_counter()
    for it in range(args.draft_steps):
        b = blocks[it % len(blocks)]
        anchors = determined_anchors(seqs, weights, b, args.draft_batch, gen)
        ce, bce, acc, cos = distill.draft_loss(model, seqs, feats, anchors, b, hidden, weights,
                                               args.draft_hidden_weight)
        opt.zero_grad(set_to_none=True)
        (ce + 0.1 * bce).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if it % 10 == 0 or it == args.draft_steps - 1:
            log(f"draft step {it:4d} B={b} loss {float(ce.detach()):.3f} determined-token top-1 per depth "
                f"{' '.join(f'{x:.2f}' for x in acc.tolist())} {time.perf_counter() - t1:.0f} s")
    for p in params:
        p.requires_grad_(False)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from deepinfer import LLM
    from deepinfer.model_executor.tiny_checkpoint import dense_value, write_checkpoint
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "train_log.txt"), "w")

    def log(msg: str) -> None:
        line = f"[{time.perf_counter() - t0:7.1f} s] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")

    raw = training_config(args.kind)
    tok = load_tokenizer()
    used = language_token_ids(tok)
    init = lambda cfg, name, shape: dense_value(cfg, name, shape, args.seed)  # noqa: E731
    work = tempfile.mkdtemp(prefix="train-tiny-")
    try:
        if args.main_from and args.init_from:
            raise SystemExit("--main-from and --init-from exclude each other")
        if args.main_from or args.init_from:
            # the config this script would train must be the one the loaded checkpoint has, so the
            # written checkpoint (raw's config) describes the weights it holds; config.json is raw as JSON
            source = args.main_from or args.init_from
            with open(os.path.join(source, "config.json")) as f:
                if json.load(f) != json.loads(json.dumps(raw)):
                    raise SystemExit(f"{source}: its config.json is not this script's "
                                     f"--kind {args.kind} training config")
        else:
            write_checkpoint(raw, work, init)
            source = work
        max_len = max(args.seq_len, 96) + 16
        # only the training batch's slots: the backward of the cache reads fills gradients the size
        # of the whole cache, so a cache larger than the batch costs time every step (the draft
        # distillation runs one sequence at a time in slot 1)
        blocks = args.batch * -(-max_len // 16) + 8
        # training writes the heads in place: no bf16 copies of them (distill_tiny_drafts.fp32_vocab_heads)
        with _tool("distill_tiny_drafts").fp32_vocab_heads():
            llm = LLM(model=source, dtype="float32", max_model_len=max_len, max_num_seqs=args.batch,
                      weight_format="dense", enforce_eager=True, num_kv_blocks=blocks)
        assert not hasattr(llm.llm_engine.worker.model.head, "weight_bf16")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worker = llm.llm_engine.worker
    model = worker.model
    if args.main_from:
        log(f"setup: {args.kind}, seed {args.seed}, main model from {args.main_from} (not trained here), "
            f"{torch.get_num_threads()} thread(s)")
    else:
        start = f", from {args.init_from}" if args.init_from else ""
        log(f"setup: {args.kind}, seed {args.seed}, {args.steps} steps of {args.batch} x {args.seq_len} tokens{start}, "
            f"{torch.get_num_threads()} thread(s)")
        train_main(model, worker, tok, used, args, log)
    if args.kind == "v41" and args.draft_steps > 0:
        distill_drafts(model, worker, tok, used, args, log)
    if args.main_from:
        # the main model's stored tensors byte for byte (quantizing its dequantized values again can
        # pick other block scales); only the distilled mtp.* tensors are encoded anew
        shutil.copytree(args.main_from, args.out, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("train_log.txt"))
        _tool("distill_tiny_drafts").write_checkpoint(args.out, args.out, model)
    else:
        state = {k: v.detach().float() if v.dtype.is_floating_point else v for k, v in model.state_dict().items()}
        write_checkpoint(raw, args.out, lambda cfg, name, shape: state[name].reshape(shape).clone())
    if args.artifact:
        n = _tool("trained_artifact").pack_artifact(args.out, args.artifact, used, args.seed)
        log(f"artifact {args.artifact}: {n / 1e6:.2f} MB")
    log(f"wrote {args.out} (total {time.perf_counter() - t0:.0f} s)")
    log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
