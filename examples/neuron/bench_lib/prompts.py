"""Random token-id prompts of an exact length, distinct across the whole run.

Token ids, not text, so the length is exact (no tokenizer drift) and the same prompt goes to the
engine, the server and transformers. Each prompt starts with its request number written in base
(high - low) digits, so no two prompts of a run are equal (and none shares a prefix long enough to
hit a prefix cache); the rest is uniform random from a seeded generator.
"""
from __future__ import annotations

import itertools

import numpy as np

# Ids 0-2 are BOS/EOS/PAD and the DeepSeek vocabulary's tail (>= 128000) is special tokens;
# staying between them keeps prompts ordinary text tokens.
LOW_ID = 3
HIGH_ID = 128000


class PromptFactory:
    def __init__(self, vocab_size: int, seed: int = 0):
        if vocab_size <= LOW_ID + 1:
            raise ValueError(f"vocab_size: must be > {LOW_ID + 1}, got {vocab_size}")
        self.low, self.high = LOW_ID, min(HIGH_ID, int(vocab_size))
        self.seed = int(seed)
        self._serial = itertools.count()

    def make(self, n: int, length: int, tag: tuple = ()) -> list[list[int]]:
        """n prompts of `length` token ids each; `tag` (e.g. the cell) seeds the random part."""
        if length < 1:
            raise ValueError(f"input length: must be >= 1, got {length}")
        rng = np.random.default_rng([self.seed, length, *tag])
        base = self.high - self.low
        prompts = []
        for _ in range(n):
            ids = rng.integers(self.low, self.high, size=length).tolist()
            serial = next(self._serial)
            for i in range(length):  # the salt: serial's digits, least significant first
                ids[i] = self.low + serial % base
                serial //= base
                if serial == 0:
                    break
            prompts.append([int(t) for t in ids])
        return prompts
