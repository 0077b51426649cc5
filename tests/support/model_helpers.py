"""Helpers for model-level tests: random-weight tiny models, step drivers over the ModelRunner (the
engine's step entry point) with a given runner strategy, runs of a loaded model with a given
chunking, and the padding check of the static-shape strategies."""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from deepinfer.model_executor.tiny_checkpoint import dense_value, v4_tiny_config, v41_tiny_config
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.worker.model_runner import ModelRunner


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
    """A few sequences fed step by step through a ModelRunner, with their own slots and blocks."""

    def __init__(self, model, strategy_cls, prompts: list[list[int]], num_slots: int = 5, num_blocks: int = 48,
                 block_size: int | None = None, kv_cache_mode: str = "plain", fp8_max: float = 448.0,
                 **strategy_kw):
        cfg = model.cfg
        self.bs = block_size or default_block_size(cfg)
        self.layout = cache_layout(cfg, num_slots, self.bs, model.engram_spec)
        self.cache = allocate_cache(cfg, num_slots, num_blocks, self.bs, torch.float32, mode=kv_cache_mode,
                                    fp8_max=fp8_max)
        self.strategy = strategy_cls(model, self.layout, **strategy_kw)
        self.runner = ModelRunner(model, self.cache, self.layout, self.strategy)
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
        logits = self.runner.run(chunks).logits
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


def run_in_lockstep(padded: "Seqs", plain: "Seqs", steps: int, tol: float = 1e-4) -> None:
    """Prefill every prompt, then decode `steps - 1` greedy tokens through two drivers fed the same
    tokens; their logits must agree at every step."""
    sizes = {i: len(t) for i, t in enumerate(plain.tokens)}
    vocab = padded.runner.model.cfg.vocab_size
    for step in range(steps):
        a, b = padded.step(sizes), plain.step(sizes)
        assert a.shape == b.shape == (len(sizes), vocab)
        assert (a - b).abs().max().item() < tol, f"step {step}"
        for row, i in enumerate(sizes):
            tok = int(b[row].argmax())
            padded.tokens[i].append(tok)
            plain.tokens[i].append(tok)
        sizes = {i: 1 for i in sizes}


def _owner_rows(cache_tensor, n_owners):
    per = cache_tensor.shape[0] // n_owners
    return torch.arange(cache_tensor.shape[0]) // per


def _all_caches(cache, slots, blocks):
    for layer, t in cache.swa.items():
        yield f"swa{layer}", t, slots
    for key, t in cache.comp_state.items():
        yield f"state{key}", t, slots
    for layer, t in cache.entries.items():
        yield f"entries{layer}", t, blocks
    for layer, t in cache.index_keys.items():
        yield f"index{layer}", t, blocks


def assert_padding_wrote_only_scratch(padded, plain, used_slots, used_blocks, slots, blocks):
    """Cache rows of the used slots/blocks agree between a padded and an unpadded run; padding wrote
    nothing outside slot 0 / block 0 (and did write there); the unpadded run never touched scratch."""
    scratch_written = False
    for (name, pa, n), (_, pl, _) in zip(_all_caches(padded, slots, blocks), _all_caches(plain, slots, blocks)):
        owner = _owner_rows(pa, n)
        used = used_slots if n == slots else used_blocks
        real = torch.tensor([int(o) in used for o in owner])
        scratch = owner == 0
        assert torch.allclose(pa[real].float(), pl[real].float(), atol=1e-5), name
        assert (pa[~real & ~scratch] == 0).all(), f"{name}: padding wrote outside slot 0 / block 0"
        assert (pl[scratch] == 0).all(), f"{name}: the unpadded run touched scratch"
        assert torch.isfinite(pa.float()).all(), name
        scratch_written |= bool((pa[scratch] != 0).any())
    assert scratch_written, "placeholders must have written the scratch slot / block"


def memory_report_cli():
    """examples/neuron/memory_report.py loaded as a module (its `main(argv)` is the command line)."""
    import importlib.util

    from tests.support import REPO
    spec = importlib.util.spec_from_file_location("memory_report_cli", REPO / "examples" / "neuron" / "memory_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
