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


class FilePrompts:
    """Prompts read from a JSON-lines file (`{"prompt": "text"}` or `{"prompt": [token ids]}` per
    line), handed out in file order and cycling: the same interface as PromptFactory, the length
    argument ignored (each prompt keeps its own length). Text is tokenized as the engine does
    (deepinfer/tokenizer.py: BOS first), so the benchmark sends token ids to every backend."""

    def __init__(self, prompts: list[list[int]]):
        if not prompts:
            raise ValueError("the prompts file has no prompts")
        self.prompts = prompts
        self._next = itertools.count()

    @classmethod
    def from_file(cls, path: str, model_dir: str) -> "FilePrompts":
        import json
        tok = None
        prompts = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    p = json.loads(line)["prompt"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a \"prompt\" key") from None
                if isinstance(p, str) and p:
                    if tok is None:
                        from deepinfer.tokenizer import load_tokenizer
                        tok = load_tokenizer(model_dir)
                    prompts.append(tok.encode(p))
                elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    prompts.append([int(t) for t in p])
                else:
                    raise ValueError(f"{path}:{lineno}: \"prompt\" must be a non-empty string or list of token ids")
        return cls(prompts)

    @property
    def max_len(self) -> int:
        return max(map(len, self.prompts))

    def make(self, n: int, length: int | None = None, tag: tuple = ()) -> list[list[int]]:
        return [list(self.prompts[next(self._next) % len(self.prompts)]) for _ in range(n)]
