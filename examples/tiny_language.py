"""The synthetic language the trained tiny checkpoints learn (docs/tiny_language.md), as a seeded
generator with no dependency on deepinfer: anyone can make prompts and check answers with it.

Four kinds of line, each ending in "\\n"; a document is many lines:
- count:       `count: 17 18 19 20`, `count by 3: 12 15 18 21` (start 0-999, step 1 or 2-9)
- copy:        `copy: river lamp door = river lamp door` (3-12 words)
- lookup:      `keys: k17=lamp k03=river ; k03 -> river` (4-32 pairs, keys k00-k99)
- long lookup: the same with keys k000-k999 and 200-800 pairs

A prompt is a line cut where the rule fixes what follows: a count after some numbers (the answer is
the next four numbers), a copy after `=`, a lookup after `->` (the answer ends the line).
`python examples/tiny_language.py --kind copy --n 3 --seed 1` prints prompts as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

# docs/tiny_language.md repeats this list on its `words:` line (tests/repo check they agree); every
# word is one token of the DeepSeek tokenizer when it follows a space.
WORDS = ("river lamp door tree house water stone bird fish apple bread chair table window book paper "
         "cloud rain snow wind fire light night day road hill field grass flower seed leaf milk honey "
         "salt sugar glass cup plate spoon knife shoe coat hat bag box key ring bell clock horse dog cat "
         "cow sheep boat ship train car wheel rope nail wall floor roof").split()
assert len(WORDS) == 64 and len(set(WORDS)) == 64

KINDS = ("count", "copy", "lookup", "long_lookup")
COUNT_ANSWER_NUMBERS = 4  # a count prompt's answer: the next four numbers of the line


@dataclass(frozen=True)
class Prompt:
    kind: str
    prompt: str
    answer: str          # the text greedy decoding must start with

    def correct(self, completion: str) -> bool:
        return completion.startswith(self.answer)


def count_line(rng: random.Random) -> list[str]:
    """The parts of a count line: the head (`count:` / `count by k:`) then the numbers."""
    step = 1 if rng.random() < 0.5 else rng.randint(2, 9)
    start = rng.randint(0, 999)
    n = rng.randint(4 + COUNT_ANSWER_NUMBERS, 12)
    head = "count:" if step == 1 else f"count by {step}:"
    return [head] + [str(start + i * step) for i in range(n)]


def copy_line(rng: random.Random) -> tuple[list[str], str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return words, "copy: " + " ".join(words) + " ="


def lookup_parts(rng: random.Random, long: bool, most_pairs: int | None = None,
                 least_pairs: int | None = None) -> tuple[str, str]:
    """(prompt ending in `->`, value); `most_pairs` lowers the largest pair count and `least_pairs`
    the smallest (a training curriculum's shorter lines; the language's lines and prompts never
    pass them)."""
    if long:
        n, keys = rng.randint(200, most_pairs or 800), [f"k{i:03d}" for i in range(1000)]
    else:
        n, keys = rng.randint(least_pairs or 4, most_pairs or 32), [f"k{i:02d}" for i in range(100)]
    chosen = rng.sample(keys, n)
    values = [rng.choice(WORDS) for _ in chosen]
    q = rng.randrange(n)
    pairs = " ".join(f"{k}={v}" for k, v in zip(chosen, values))
    return f"keys: {pairs} ; {chosen[q]} ->", values[q]


def line(rng: random.Random, kind: str) -> str:
    """One whole line of `kind`, with its trailing newline."""
    if kind == "count":
        parts = count_line(rng)
        return parts[0] + " " + " ".join(parts[1:]) + "\n"
    if kind == "copy":
        words, head = copy_line(rng)
        return head + " " + " ".join(words) + "\n"
    if kind in ("lookup", "long_lookup"):
        head, value = lookup_parts(rng, kind == "long_lookup")
        return f"{head} {value}\n"
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def document(rng: random.Random, lines: int, kinds=("count", "copy", "lookup")) -> str:
    """`lines` lines, each of a kind drawn uniformly from `kinds`."""
    return "".join(line(rng, rng.choice(kinds)) for _ in range(lines))


def prompt(rng: random.Random, kind: str) -> Prompt:
    if kind == "count":
        parts = count_line(rng)
        shown = rng.randint(3, len(parts) - 1 - COUNT_ANSWER_NUMBERS)
        text = parts[0] + " " + " ".join(parts[1:1 + shown])
        return Prompt(kind, text, "".join(" " + x for x in parts[1 + shown:1 + shown + COUNT_ANSWER_NUMBERS]))
    if kind == "copy":
        words, head = copy_line(rng)
        return Prompt(kind, head, " " + " ".join(words) + "\n")
    if kind in ("lookup", "long_lookup"):
        head, value = lookup_parts(rng, kind == "long_lookup")
        return Prompt(kind, head, f" {value}\n")
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


# Seed streams: training documents and held-out prompts never share a generator.
HELDOUT_SEED_OFFSET = 1_000_003


def heldout_prompts(kind: str, n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of `kind` from the held-out stream of `seed` (never the training stream)."""
    rng = random.Random(f"heldout/{kind}/{seed + HELDOUT_SEED_OFFSET}")
    return [prompt(rng, kind) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=KINDS, default="copy")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--documents", type=int, default=0,
                    help="print this many training-stream documents of --lines lines (as JSON lines "
                         "{\"text\": ...}) instead of held-out prompts")
    ap.add_argument("--lines", type=int, default=8)
    args = ap.parse_args(argv)
    if args.documents:
        rng = random.Random(f"documents/{args.seed}")
        for _ in range(args.documents):
            print(json.dumps({"text": document(rng, args.lines)}))
        return 0
    for p in heldout_prompts(args.kind, args.n, args.seed):
        print(json.dumps({"prompt": p.prompt, "answer": p.answer, "kind": p.kind}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
