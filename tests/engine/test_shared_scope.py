"""The shared scope of a prompt chunk (forward_meta.CompressMeta.scope_idx, docs/neuron.md §4 B7):
the indexer scores the keys the chunk's last row sees, gathered once, and the attention takes each
row's selected records from the records gathered once; rows of other sequences in the step keep
their own gathers (row_chunks.scope_branch). Both paths give every row the same bits, in eager steps
and in compiled region graphs (the rule's check)."""
import dataclasses

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor import forward_meta
from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs
from deepinfer.model_executor.layers import row_chunks
from deepinfer.model_executor.models import deepseek_v4, v4_attention
from deepinfer.neuron_ops.regions import RegionRunner
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import run_batch


@pytest.fixture(scope="module")
def models(tiny_v4_dir, tiny_v41_dir):
    """Each tiny checkpoint's model, built once for the module."""
    return {kind: build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False)
            for kind, d in (("v4", tiny_v4_dir), ("v41", tiny_v41_dir))}


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 128000, (n - 1,), generator=g).tolist()


def test_scope_is_the_longest_real_chunks_last_row(tiny_v41_dir):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 4, bs, None)
    ids = _ids(96, 1)
    chunks = [SeqChunk(1, 60, 1, list(range(1, 9)), ids),            # a decode row
              SeqChunk(2, 16, 40, list(range(9, 17)), ids),          # the longest real chunk: the scope
              SeqChunk(3, 0, 40, list(range(17, 25)), ids),          # as long, later: not the scope
              SeqChunk(0, 0, 50, [0], [0] * 50, num_logits=0)]       # a placeholder, longer still
    step = build_step_inputs(chunks, layout)
    for m in step.comp.values():
        in_scope = m.in_scope
        assert in_scope.tolist() == [False] + [True] * 40 + [False] * 90
        last = 40
        assert torch.equal(m.scope_idx, m.vis_idx[last])
        for t in torch.nonzero(in_scope).flatten().tolist():   # each scope row sees a prefix of the scope
            n = int(m.n_vis[t])
            assert torch.equal(m.vis_idx[t, :n], m.scope_idx[:n]) and not m.vis_valid[t, n:].any()
    decode = build_step_inputs([SeqChunk(1, 60, 1, list(range(1, 9)), ids),
                                SeqChunk(2, 30, 1, list(range(9, 17)), ids)], layout)
    assert all(m.scope_idx is None and m.in_scope is None for m in decode.comp.values())


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_shared_scope_and_own_gathers_give_the_same_logits(models, kind, monkeypatch):
    model = models[kind]
    least = forward_meta.SEQ_SCOPE_MIN_ROWS
    # one step: two prompts long enough for their own scopes, two that gather per row
    prompts = [_ids(least + 8, 3), _ids(least, 4), _ids(20, 5), _ids(2, 6)]
    seen = []
    real_scope_chunks = v4_attention.scope_chunks
    monkeypatch.setattr(v4_attention, "scope_chunks", lambda *a: seen.append(a[-1]) or real_scope_chunks(*a))
    per_sequence = run_batch(model, prompts)            # eager: each long prompt chunk reads its own scope
    assert seen and all(s == ((0, least + 8), (least + 8, 2 * least + 8)) for s in seen)
    real_chunks, real_branch = v4_attention.row_chunks, v4_attention.scope_branch
    taken = []

    def branch(in_scope, shared, own, args, part=""):
        taken.append(bool(in_scope.all()))
        return real_branch(in_scope, shared, own, args, part)
    monkeypatch.setattr(v4_attention, "scope_branch", branch)
    # one scope (what a graph reads), in chunks of 16 rows: chunks inside the longest prompt read
    # the scope, the rest their own rows
    monkeypatch.setattr(forward_meta, "_seq_scopes", lambda chunks, start: None)
    monkeypatch.setattr(v4_attention, "row_chunks", lambda rows, per_row, budget=None: real_chunks(
        rows, per_row, budget=16 * per_row))
    mixed = run_batch(model, prompts)
    assert True in taken and False in taken
    monkeypatch.setattr(v4_attention, "scope_branch", lambda in_scope, shared, own, args, part="": own(*args))
    own = run_batch(model, prompts)
    for a, b, c in zip(per_sequence, mixed, own):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_eager_prompt_chunks_each_read_their_own_scope(tiny_v41_dir):
    """forward_meta.StepInputs.seq_scopes: the rows of every real chunk feeding at least
    SEQ_SCOPE_MIN_ROWS tokens; row_chunks.scope_chunks covers the step's rows in order, a chunk's
    ranges carrying its last row, the other rows None; static steps (graph inputs) carry none."""
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 6, bs, None)
    ids = _ids(160, 1)
    least = forward_meta.SEQ_SCOPE_MIN_ROWS
    table = list(range(1, 1 + -(-160 // bs)))
    chunks = [SeqChunk(1, 60, 1, table, ids),                     # a decode row
              SeqChunk(2, 16, least + 6, table, ids),             # rows 1 .. least + 6
              SeqChunk(3, 60, 1, table, ids),                     # a decode row
              SeqChunk(4, 0, least, table, ids),                  # its own scope from `least` rows
              SeqChunk(5, 0, least - 1, table, ids),              # one row short: own gathers
              SeqChunk(0, 0, 90, [0], [0] * 90, num_logits=0)]    # a placeholder: never a scope
    step = build_step_inputs(chunks, layout)
    a, b = 1, least + 7
    c, d = b + 1, b + 1 + least
    assert step.seq_scopes == ((a, b), (c, d))
    assert build_step_inputs(chunks, layout, seq_scopes=False).seq_scopes is None
    assert build_step_inputs(chunks[:1], layout).seq_scopes is None            # decode only
    assert build_step_inputs(chunks[4:], layout).seq_scopes is None            # no chunk long enough
    ranges = row_chunks.scope_chunks(step.num_tokens, 1, 1, step.seq_scopes)
    assert ranges == [(0, a, None), (a, b, b - 1), (b, c, None), (c, d, d - 1), (d, step.num_tokens, None)]
    small = row_chunks.scope_chunks(step.num_tokens, row_chunks.CHUNK_BYTES // 16, 1, step.seq_scopes)
    assert [r for r in small if r[2] == b - 1] == [(s, min(b, s + 16), b - 1) for s in range(a, b, 16)]
    for m in step.comp.values():   # a chunk's rows see a prefix of what its last row sees
        for lo, hi in step.seq_scopes:
            for t in range(lo, hi):
                n = int(m.n_vis[t])
                assert torch.equal(m.vis_idx[t, :n], m.vis_idx[hi - 1, :n]) and not m.vis_valid[t, n:].any()


class _CacheGathers(TorchDispatchMode):
    """The index shapes of every advanced-indexing read of the given cache tensors."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index.Tensor and args[0].untyped_storage().data_ptr() in self.storages:
            self.shapes += [tuple(i.shape) for i in args[1] if i is not None]
        return func(*args, **(kwargs or {}))


def test_a_prompt_chunk_reads_the_compressed_caches_once_per_layer_decode_per_row(models):
    """docs/neuron.md §4 B7: a prompt chunk reads each entry / index-key cache once, a 1-D gather of
    the scope; only a decode step gathers [rows, entries] per row."""
    model = models["v41"]
    cfg = model.cfg
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 4, bs, model.engram_spec)
    cache = allocate_cache(cfg, 4, 12, bs, torch.float32)
    ids = _ids(80, 6)
    compressed = list(cache.entries.values()) + list(cache.index_keys.values())
    table = list(range(1, 11))
    prompt = _CacheGathers(compressed)
    with prompt:
        model(build_step_inputs([SeqChunk(1, 0, 60, table, ids, 1)], layout), cache)
    decode = _CacheGathers(compressed)
    with decode:
        model(build_step_inputs([SeqChunk(1, 60, 1, table, ids, 1), SeqChunk(2, 0, 1, [11], ids, 1)], layout), cache)
    assert prompt.shapes and all(len(s) == 1 for s in prompt.shapes)
    readers = sum(1 for layer in model.layers if layer.attn.ratio > 0)
    entry_reads = [s for s in prompt.shapes if s[0] > 0]
    assert readers <= len(entry_reads) <= 2 * readers    # the records, and the keys where a layer indexes
    assert decode.shapes and any(len(s) == 2 and s[0] == 2 for s in decode.shapes)
    # an eager step of two prompts: each chunk's scope is one 1-D gather, no row gathers its own
    rows = forward_meta.SEQ_SCOPE_MIN_ROWS
    ids = _ids(rows + 8, 9)
    per_seq = -(-len(ids) // bs)
    cache = allocate_cache(cfg, 4, 1 + 2 * per_seq, bs, torch.float32)
    two = _CacheGathers(list(cache.entries.values()) + list(cache.index_keys.values()))
    with two:
        model(build_step_inputs([SeqChunk(1, 0, rows + 8, list(range(1, 1 + per_seq)), ids, 1),
                                 SeqChunk(2, 0, rows, list(range(1 + per_seq, 1 + 2 * per_seq)), ids, 1)],
                                layout), cache)
    assert two.shapes and all(len(s) == 1 for s in two.shapes)
    assert 2 * len(entry_reads) == len([s for s in two.shapes if s[0] > 0])



_COLLECT = deepseek_v4.DecoderLayer.collect


def _steps_of_two_sequences(model):
    """A mixed prompt step (the scope sequence's 28-token chunk and a second sequence's 12), then a
    verification-shaped step (4 tokens each: the next token and 3 drafts), and a fresh cache. Static
    shapes (the sync-free MoE a region graph needs) for eager and compiled runs alike."""
    cfg = model.cfg
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 3, bs, model.engram_spec)
    a, b = _ids(40, 7), _ids(24, 8)
    ta, tb = list(range(1, 5)), list(range(5, 9))
    steps = [[SeqChunk(1, 0, 28, ta, a, 28), SeqChunk(2, 0, 12, tb, b, 12)],
             [SeqChunk(1, 28, 4, ta, a, 4), SeqChunk(2, 12, 4, tb, b, 4)]]
    return ([dataclasses.replace(build_step_inputs(c, layout), static_shapes=True) for c in steps],
            allocate_cache(cfg, 3, 10, bs, torch.float32))


def _run_steps(model, monkeypatch, branch, regions=None):
    """Each step's logits and every index source's selections, the layers eager (`regions` None) or
    compiled regions, with `branch` as row_chunks.scope_branch, in chunks of 4 rows: the chunks
    inside the scope sequence's rows read the scope, the rest their own rows."""
    steps, cache = _steps_of_two_sequences(model)
    real_chunks = row_chunks.row_chunks
    monkeypatch.setattr(v4_attention, "row_chunks", lambda rows, per_row, budget=None: real_chunks(
        rows, per_row, budget=4 * per_row))
    monkeypatch.setattr(v4_attention, "scope_branch", branch)
    selections = []

    def collect(layer, io, ctx):
        if layer.attn.is_index_source:
            selections.append(io.topk_out)
        return _COLLECT(layer, io, ctx)
    monkeypatch.setattr(deepseek_v4.DecoderLayer, "collect", collect)
    logits = [model(step, cache, run_layer=None if regions is None else
                    regions.hook(len(step.logits_indices), step.num_tokens, prompt=True)) for step in steps]
    return logits, selections


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_compiled_indexer_reads_the_scope_with_the_eager_selections(models, kind, monkeypatch):
    """Compiled whole-layer regions (aot_eager): the indexer and the attention read the shared scope
    through their torch.cond, and every index source's selections and the greedy tokens of a mixed
    prompt step and a verification step equal eager's and the per-row reference's. At V4.1 a DSpark
    target layer writes its target output before the indexer's cond: there the selection written
    after it was once lost (models/v4_common.py LayerIO)."""
    model = models[kind]
    if kind == "v41":
        assert any(layer.is_target and layer.attn.is_index_source for layer in model.layers)
    eager, eager_sel = _run_steps(model, monkeypatch, row_chunks.scope_branch)
    per_row, per_row_sel = _run_steps(model, monkeypatch, lambda in_scope, shared, own, args, part="": own(*args))
    traced = set()

    def branch(in_scope, shared, own, args, part=""):
        if torch.compiler.is_compiling():
            traced.add(part)
        return row_chunks.scope_branch(in_scope, shared, own, args, part)
    torch._dynamo.reset()
    runner = RegionRunner("aot_eager")
    compiled, compiled_sel = _run_steps(model, monkeypatch, branch, runner)
    assert traced == {"indexer", "attention"}
    assert runner.stats.total_graphs == 2 * runner.num_kinds     # one graph a kind per step shape
    assert len(compiled_sel) == len(eager_sel) == len(per_row_sel) > 0
    for c, e, p in zip(compiled_sel, eager_sel, per_row_sel):
        assert c is not None and torch.equal(c, e) and torch.equal(c, p)
    for c, e, p in zip(compiled, eager, per_row):
        assert torch.equal(e, p)
        assert (c - e).abs().max().item() < 1e-4 and torch.equal(c.argmax(-1), e.argmax(-1))
