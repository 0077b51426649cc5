"""Helpers for the Neuron host-mode tests: random-weight tiny models and step drivers."""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from deepinfer.model_executor.tiny_checkpoint import dense_value, v4_tiny_config, v41_tiny_config
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size


def tiny_config(kind: str, layers: int | None = None, **over) -> ModelConfig:
    raw = v4_tiny_config(layers or 6) if kind == "v4" else v41_tiny_config(layers or 8)
    cfg = ModelConfig.from_dict(raw)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(cfg: ModelConfig, platform=None, seed: int = 0, like: DeepseekV4Model | None = None) -> DeepseekV4Model:
    """The tiny checkpoint generator's dense (pre-quantization) weights, or a copy of `like`'s."""
    model = DeepseekV4Model(cfg, torch.float32, platform=platform)
    if like is not None:
        model.load_state_dict(like.state_dict())
    else:
        sd = model.state_dict()
        with torch.no_grad():
            for name, t in sd.items():
                t.copy_(dense_value(cfg, name, tuple(t.shape), seed).to(t.dtype))
    model.post_load()
    return model.eval()


class Seqs:
    """A few sequences fed step by step through a runner, with their own slots and blocks."""

    def __init__(self, model, runner_cls, prompts: list[list[int]], num_slots: int = 5, num_blocks: int = 48,
                 block_size: int | None = None, **runner_kw):
        cfg = model.cfg
        self.bs = block_size or default_block_size(cfg)
        self.layout = cache_layout(cfg, num_slots, self.bs, model.engram_spec)
        self.cache = allocate_cache(cfg, num_slots, num_blocks, self.bs, torch.float32)
        self.runner = runner_cls(model, self.layout, **runner_kw)
        self.tokens = [list(p) for p in prompts]
        self.done = [0] * len(prompts)
        per = (num_blocks - 1) // len(prompts)
        self.tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]

    def chunk(self, i: int, n: int) -> SeqChunk:
        return SeqChunk(slot=i + 1, ctx_len=self.done[i], num_new=n, block_table=self.tables[i],
                        token_ids=self.tokens[i], num_logits=1)

    def step(self, sizes: dict[int, int]) -> torch.Tensor:
        """Feed sizes[i] tokens of sequence i (already in self.tokens); returns one logits row each."""
        chunks = [self.chunk(i, n) for i, n in sizes.items()]
        logits = self.runner.run(chunks, self.cache)
        for i, n in sizes.items():
            self.done[i] += n
        return logits

    def greedy(self, steps: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode greedily; returns the generated ids."""
        out = [[] for _ in self.tokens]
        sizes = {i: len(t) - self.done[i] for i, t in enumerate(self.tokens)}
        for _ in range(steps):
            logits = self.step(sizes)
            for row, i in enumerate(sizes):
                tok = int(logits[row].argmax())
                out[i].append(tok)
                self.tokens[i].append(tok)
            sizes = {i: 1 for i in range(len(self.tokens))}
        return out
