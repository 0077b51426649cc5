"""Helpers for model-level tests: run a loaded model over prompts with a given chunking."""
import torch

from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size


def run_chunks(model, token_ids: list[int], chunks: list[int], dtype=torch.float32, mode="plain") -> torch.Tensor:
    """Logits of every position of one sequence fed in the given chunk sizes (slot 1, blocks 1..)."""
    cfg = model.cfg
    bs = default_block_size(cfg)
    n_blocks = -(-len(token_ids) // bs)
    layout = cache_layout(cfg, 2, bs, model.engram_spec)
    cache = allocate_cache(cfg, 2, n_blocks + 1, bs, dtype, mode=mode)
    out, pos = [], 0
    for c in chunks:
        step = build_step_inputs([SeqChunk(1, pos, c, list(range(1, n_blocks + 1)), token_ids, c)], layout)
        out.append(model(step, cache))
        pos += c
    assert pos == len(token_ids)
    return torch.cat(out)


def run_batch(model, prompts: list[list[int]], dtype=torch.float32) -> list[torch.Tensor]:
    """Prefill several sequences in one step; returns each sequence's logits."""
    cfg = model.cfg
    bs = default_block_size(cfg)
    chunks, nxt = [], 1
    for i, p in enumerate(prompts):
        nb = -(-len(p) // bs)
        chunks.append(SeqChunk(i + 1, 0, len(p), list(range(nxt, nxt + nb)), p, len(p)))
        nxt += nb
    layout = cache_layout(cfg, len(prompts) + 1, bs, model.engram_spec)
    cache = allocate_cache(cfg, len(prompts) + 1, nxt, bs, dtype)
    logits = model(build_step_inputs(chunks, layout), cache)
    return list(torch.split(logits, [len(p) for p in prompts]))
