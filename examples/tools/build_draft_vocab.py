"""Build a draft vocabulary (deepinfer/model_executor/models/draft_vocab.py): the `--size` most frequent
tokens of a corpus under the checkpoint's tokenizer, the only tokens DSpark drafts may then take
(engine option speculative_draft_vocab; bench tools' --draft-vocab).

    python examples/tools/build_draft_vocab.py --model DIR --corpus FILE [FILE ...] --size N --out VOCAB.json

A corpus file is plain text, or JSON lines whose "prompt", "text" and "answer" fields are joined (what
`examples/tiny_language.py` prints). Choose a corpus like the traffic the engine serves: a token the
corpus never shows is never drafted. The file records the counts' coverage: the share of the corpus's
tokens the kept ids cover is an upper bound on how often the next token can be drafted at all.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer

from deepinfer.model_executor.models.draft_vocab import rank_tokens


def corpus_texts(path: Path):
    """The texts of one corpus file (module docstring)."""
    text = path.read_text()
    lines = text.splitlines()
    try:
        docs = [json.loads(x) for x in lines if x.strip()]
    except ValueError:
        yield text
        return
    for d in docs:
        if not isinstance(d, dict):
            yield json.dumps(d)
            continue
        yield "".join(str(d.get(k, "")) for k in ("prompt", "text", "answer"))


def count_tokens(tokenizer: Tokenizer, paths: list[Path]) -> Counter:
    counts: Counter = Counter()
    for p in paths:
        for text in corpus_texts(p):
            counts.update(tokenizer.encode(text, add_special_tokens=False).ids)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory (its tokenizer.json)")
    ap.add_argument("--corpus", type=Path, nargs="+", required=True)
    ap.add_argument("--size", type=int, required=True, help="tokens to keep (at most the corpus's distinct ones)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    counts = count_tokens(tokenizer, args.corpus)
    if not counts:
        ap.error("the corpus has no tokens")
    ids = rank_tokens(counts, args.size)
    total = sum(counts.values())
    covered = sum(counts[t] for t in ids) / total
    args.out.write_text(json.dumps({
        "token_ids": ids, "size": len(ids), "corpus_tokens": total, "corpus_distinct": len(counts),
        "coverage": round(covered, 6), "corpus": [str(p) for p in args.corpus],
        "vocab_size": tokenizer.get_vocab_size()}) + "\n")
    print(f"{len(ids)} of {len(counts)} distinct tokens ({total} in the corpus), covering {covered:.4%}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
