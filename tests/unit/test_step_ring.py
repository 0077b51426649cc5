"""The step message codec, the /dev/shm step ring and the data-parallel split, without processes
(the multi-rank tests run them across real ones: tests/process/test_multi_rank_engine.py)."""
from __future__ import annotations

import os

import pytest
import torch

from deepinfer.distributed.step_codec import (KIND_SHUTDOWN, KIND_STEP, GroupStep, StepMessage, decode, encode,
                                              to_bytes)
from deepinfer.distributed.step_ring import SHM_DIR, StepRing, our_segments
from deepinfer.model_executor.forward_meta import SEQ_SCOPE_MIN_ROWS, SeqChunk, build_step_inputs
from deepinfer.model_executor.static_step import Bucket, BucketSpec
from deepinfer.worker.cache_engine import cache_layout
from deepinfer.executor.step_fanout import split_groups
from tests.support.model_helpers import tiny_config


def _layout(kind="v41"):
    cfg = tiny_config(kind)
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    with torch.device("meta"):
        spec = DeepseekV4Model(cfg, torch.float32).engram_spec
    return cache_layout(cfg, 5, 64, spec)


def _chunks():
    ids = list(range(3, 200))
    return [SeqChunk(slot=1, ctx_len=0, num_new=9, block_table=[1, 2], token_ids=ids, num_logits=1),
            SeqChunk(slot=2, ctx_len=70, num_new=1, block_table=[3, 4], token_ids=ids, num_logits=1)]


def _same(a, b) -> None:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), name
            for k in x:
                _same(x[k], y[k])
        else:
            assert x == y, name


def test_codec_round_trips_a_step_every_field():
    layout = _layout()
    eager = build_step_inputs(_chunks(), layout)
    spec = BucketSpec(batch=(1, 2, 4), contexts=None, prefill_tokens=(16,), max_model_len=128)
    bucket = spec.select(_chunks())
    static = spec.static_step(_chunks(), bucket, layout)
    assert eager.ngram_ids is not None and eager.comp   # V4.1: Engram ids and compressor metadata travel
    msg = StepMessage(KIND_STEP, [GroupStep(eager, None, 2), GroupStep(static, bucket, 2)], gather_rows=2)
    back = decode(to_bytes(msg))
    assert back.kind == KIND_STEP and back.gather_rows == 2
    _same(back.groups[0].step, eager)
    _same(back.groups[1].step, static)
    assert back.groups[1].bucket == bucket and back.groups[0].bucket is None
    assert back.groups[1].step.static_shapes
    only = decode(to_bytes(msg), group=1)      # a rank decodes its own group only
    assert only.groups[0] is None
    _same(only.groups[1].step, static)
    assert decode(to_bytes(StepMessage(KIND_SHUTDOWN))).kind == KIND_SHUTDOWN
    # an eager step whose prompt chunks read their own scopes: the row ranges travel as a tuple
    rows = SEQ_SCOPE_MIN_ROWS
    ids = list(range(3, 3 + 2 * rows))
    scoped = build_step_inputs([SeqChunk(1, 0, rows, [1], ids, 1), SeqChunk(2, 0, rows + 1, [2, 3], ids, 1)],
                               layout)
    assert scoped.seq_scopes == ((0, rows), (rows, 2 * rows + 1))
    back = decode(to_bytes(StepMessage(KIND_STEP, [GroupStep(scoped, None, 2)], gather_rows=2))).groups[0].step
    _same(back, scoped)
    assert back.seq_scopes == scoped.seq_scopes


def test_codec_carries_a_greedy_speculative_steps_plan_rows():
    from deepinfer.distributed.step_codec import KIND_GREEDY_SPEC
    layout = _layout()
    step = build_step_inputs(_chunks(), layout)
    plan = torch.arange(2 * 10, dtype=torch.long).view(2, 10)
    back = decode(to_bytes(StepMessage(KIND_GREEDY_SPEC, [GroupStep(step, None, 1, plan), GroupStep(step, None, 0)],
                                       gather_rows=2)))
    assert back.kind == KIND_GREEDY_SPEC
    assert back.groups[0].plan.dtype == torch.long and torch.equal(back.groups[0].plan, plan)
    assert back.groups[1].plan is None
    _same(back.groups[0].step, step)


def test_ring_passes_messages_in_order_and_holds_back_the_writer():
    ring = StepRing.create(num_slots=2, slot_size=1 << 16, num_readers=2)
    try:
        readers = [StepRing.open(ring.name, ring.size, i) for i in range(2)]
        assert ring.name in our_segments()
        ring.unlink()   # mapped by everyone: the name can go, the mappings stay
        assert ring.name not in our_segments()
        msgs = [StepMessage(KIND_STEP, [GroupStep(build_step_inputs(_chunks()[:k], _layout("v4")), None, k)], k)
                for k in (1, 2)]
        for m in msgs:
            ring.write(*encode(m))
        def stop():
            raise RuntimeError("stop waiting")
        with pytest.raises(RuntimeError, match="stop waiting"):   # both slots unread: a third write waits
            ring.write(*encode(msgs[0]), check=stop)
        for r in readers:
            got = [decode(r.read(timeout_s=5)) for _ in msgs]
            assert [g.gather_rows for g in got] == [1, 2]
            _same(got[1].groups[0].step, msgs[1].groups[0].step)
        ring.write(*encode(StepMessage(KIND_SHUTDOWN)), timeout_s=5)   # a slot is free again
        assert all(decode(r.read(timeout_s=5)).kind == KIND_SHUTDOWN for r in readers)
        for r in readers:
            r.close()
    finally:
        ring.close()
    assert ring.name not in our_segments()


def test_ring_rejects_a_size_mismatch_and_an_oversized_message():
    ring = StepRing.create(num_slots=2, slot_size=4096, num_readers=1)
    try:
        with pytest.raises(RuntimeError, match="segment has .* bytes, the driver announced"):
            StepRing.open(ring.name, ring.size + 4096, 0)
        with pytest.raises(RuntimeError, match="does not match"):
            StepRing.open(ring.name, ring.size, 1)       # a reader index the ring has no room for
        big = StepMessage(KIND_STEP, [GroupStep(build_step_inputs(_chunks(), _layout()), None, 2)], 2)
        with pytest.raises(ValueError, match="does not fit the 4096-byte slots"):
            ring.write(*encode(big))
        with pytest.raises(FileNotFoundError):
            StepRing.open("deepinfer-ring-" + "0" * 16, ring.size, 0)
        assert os.path.exists(os.path.join(SHM_DIR, ring.name))
    finally:
        ring.close()


def _chunk(slot, ctx, n):
    return SeqChunk(slot=slot, ctx_len=ctx, num_new=n, block_table=[slot], token_ids=[1] * (ctx + n), num_logits=1)


def test_split_groups_by_slot_with_equal_rows():
    decode_rows = [_chunk(1, 5, 1), _chunk(2, 5, 1), _chunk(3, 5, 1), _chunk(5, 5, 1)]
    per, index = split_groups(decode_rows, 2)
    assert index == [[1], [0, 2, 3]]                  # slot % dp: slots 2 | 1, 3, 5
    assert [len(g) for g in per] == [3, 3] and all(c.num_new == 1 for g in per for c in g)
    assert [c.slot for c in per[0]] == [2, 0, 0]      # placeholders: scratch slot, no logits
    assert all(c.num_logits == 0 for c in per[0][1:])
    mixed = [_chunk(1, 0, 6), _chunk(2, 9, 1), _chunk(4, 9, 1)]
    per, index = split_groups(mixed, 2)
    tokens = [sum(c.num_new for c in g) for g in per]
    assert tokens[0] == tokens[1]
    # every group has a chunk of >= 2 tokens, so both pick a prompt bucket of the same size
    assert all(any(c.num_new >= 2 for c in g) for g in per)
    spec = BucketSpec(batch=(1, 2, 4), contexts=None, prefill_tokens=(16,), max_model_len=64)
    buckets = [spec.select(g) for g in per]
    assert buckets[0].num_tokens == buckets[1].num_tokens == 16
    with pytest.raises(ValueError, match="scratch slot"):
        split_groups([_chunk(0, 0, 1)], 2)


def test_data_parallel_groups_get_buckets_of_one_token_count():
    """BucketSpec.common_buckets: a group of two verification rows and one of a short verification row
    (its group padding would be a placeholder longer than a verification row, a prompt bucket) both run
    the verification bucket; a group with a prompt chunk takes every group to the prompt bucket; a
    group without rows takes the others' count; decode-only groups keep decode buckets."""
    spec = BucketSpec(batch=(4,), contexts=None, prefill_tokens=(64,), max_model_len=64, verify_tokens=4)
    verify = [[_chunk(2, 9, 2)], [_chunk(1, 9, 4), _chunk(3, 12, 4)]]
    assert spec.select(split_groups([verify[1][0], verify[0][0], verify[1][1]], 2)[0][0]).num_tokens == 64
    b = spec.common_buckets(verify)
    assert [x.num_tokens for x in b] == [16, 16] and b[1] == spec.select(verify[1])
    prompt = spec.common_buckets([[_chunk(2, 0, 10)], [_chunk(1, 9, 4)]])
    assert [x.num_tokens for x in prompt] == [64, 64]
    empty = spec.common_buckets([[], [_chunk(1, 9, 4), _chunk(3, 12, 4)]])
    assert [x.num_tokens for x in empty] == [16, 16]
    decode = spec.common_buckets([[_chunk(2, 9, 1)], [_chunk(1, 9, 1), _chunk(3, 9, 1)]])
    assert all(x.num_seqs == x.num_tokens == 4 for x in decode)
    # a group no bucket holds (a 70-token chunk, prompt buckets of 64): every group eager
    assert spec.common_buckets([[_chunk(2, 0, 70)], [_chunk(1, 9, 4)]]) == [None, None]


def test_draft_blocks_round_trip_and_pad_groups_with_placeholder_rows():
    """A draft block message (KIND_DRAFT) keeps every field; with dp 2 each group drafts its own
    sequences (slot % 2) padded with placeholder rows that select no expert, and the gather order puts
    each sequence's B rows back where the block had them."""
    from types import SimpleNamespace

    from deepinfer.distributed.step_codec import KIND_DRAFT
    from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
    from deepinfer.worker.runners.eager import EagerStrategy
    from deepinfer.executor.step_fanout import StepFanout
    layout = _layout()
    block = DraftBlock(slots=[1, 2, 3], last_pos=[4, 9, 20], first_tokens=[11, 12, 13], block=3)
    step = draft_step_inputs(block, layout, 128000)
    assert step.token_valid is None
    back = decode(to_bytes(StepMessage(KIND_DRAFT, [GroupStep(step, None, 9)], 9)))
    assert back.kind == KIND_DRAFT
    _same(back.groups[0].step, step)

    strategy = EagerStrategy(None, layout)
    driver = SimpleNamespace(dp=2, dp_rank=0)
    prepared = StepFanout(driver, None, None).prepare_draft(strategy, block, 128000)
    groups = prepared.fanout.message.groups
    assert [g.num_logits for g in groups] == [3, 6] and prepared.fanout.gather_rows == 6
    odd = groups[1].step   # slots 1 and 3
    assert odd.token_valid is None and odd.input_ids.view(2, 3)[:, 0].tolist() == [11, 13]
    even = groups[0].step  # slot 2 and one placeholder row
    assert even.token_valid.tolist() == [True] * 3 + [False] * 3
    assert even.input_ids.view(2, 3)[:, 0].tolist() == [12, 0]
    # gathered rows: group 0 rows 0..5 (slot 2, placeholder), group 1 rows 6..11 (slots 1, 3)
    assert prepared.fanout.order.tolist() == [6, 7, 8, 0, 1, 2, 9, 10, 11]


def test_ring_slots_hold_verification_rows_and_draft_blocks(tiny_v41_dir):
    """slot_bytes sizes the ring for the largest speculative messages too."""
    from deepinfer.config import ModelConfig
    from deepinfer.distributed.step_codec import KIND_DRAFT
    from deepinfer.engine_config import EngineConfig
    from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
    from deepinfer.worker.runners.eager import EagerStrategy
    from deepinfer.executor.step_fanout import slot_bytes
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    ec = EngineConfig(model=str(tiny_v41_dir), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=96,
                      num_speculative_tokens=5).resolve(cfg)
    layout = _layout()
    strategy = EagerStrategy(None, layout)
    size = slot_bytes(strategy, ec, 1)
    table = list(range(1, 9))
    rows = [SeqChunk(slot=s + 1, ctx_len=500, num_new=6, block_table=table, token_ids=[1] * 506, num_logits=6)
            for s in range(16)]
    step, _ = strategy.prepare_host(rows)
    assert len(to_bytes(StepMessage(KIND_STEP, [GroupStep(step, None, 96)], 0))) <= size
    block = DraftBlock(list(range(1, 17)), [505] * 16, [1] * 16, 5)
    draft = StepMessage(KIND_DRAFT, [GroupStep(draft_step_inputs(block, layout, 0), None, 80)], 0)
    assert len(to_bytes(draft)) <= size
