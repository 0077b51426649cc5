"""Static buckets: selection, context buckets, entry caps, and static StepInputs shapes."""
import pytest

from deepinfer.model_executor.forward_meta import CacheLayout, SeqChunk, build_step_inputs
from deepinfer.platforms.neuron.buckets import batch_buckets
from deepinfer.model_executor.static_step import Bucket, BucketSpec, entry_cap, pad_chunks, pad_step


def test_batch_buckets_are_powers_of_two():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 8)
    assert batch_buckets(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def _chunk(ctx, new, slot=1):
    return SeqChunk(slot=slot, ctx_len=ctx, num_new=new, block_table=[1, 2, 3], token_ids=[5] * (ctx + new))


def test_select_decode_prefill_and_overflow():
    spec = BucketSpec(batch=(1, 2, 4), contexts=None, prefill_tokens=32, max_model_len=200)
    assert spec.select([_chunk(10, 1)] * 3) == Bucket(4, 4, 64)
    assert spec.select([_chunk(70, 1)]) == Bucket(1, 1, 128)
    assert spec.select([_chunk(150, 1)]) == Bucket(1, 1, 200)       # capped at max_model_len
    assert spec.select([_chunk(0, 20), _chunk(5, 1)]) == Bucket(3, 32, 64)   # prompt chunk + a decode
    assert spec.select([_chunk(0, 32)]) == Bucket(1, 32, 64)        # exactly the prefill bucket
    assert spec.select([_chunk(0, 33)]) is None                     # too many tokens: eager
    assert spec.select([_chunk(1, 1)] * 5) is None                  # too many rows: eager
    assert BucketSpec(batch=(1,), contexts=None, prefill_tokens=None).select([_chunk(0, 4)]) is None


def test_prompt_step_runs_in_the_smallest_prefill_bucket_that_holds_it():
    spec = BucketSpec(batch=(1, 2), contexts=None, prefill_tokens=(64, 16), max_model_len=256)
    assert spec.prefill_tokens == (16, 64)
    assert spec.select([_chunk(0, 10)]) == Bucket(2, 16, 64)
    assert spec.select([_chunk(0, 16)]) == Bucket(1, 16, 64)
    assert spec.select([_chunk(0, 17)]) == Bucket(2, 64, 64)
    assert spec.select([_chunk(0, 65)]) is None


def test_short_prompt_keeps_a_small_context_bucket():
    """A 5-token prompt in a 64-token prefill bucket: the 59 placeholder tokens are split into
    chunks that fit the real rows' context bucket instead of raising it to 64."""
    spec = BucketSpec(batch=(1, 2), contexts=(16, 64, 256), prefill_tokens=64, max_model_len=256)
    bucket = spec.select([_chunk(0, 5)])
    assert bucket == Bucket(num_seqs=1 + 4, num_tokens=64, context=16)
    padded = pad_chunks([_chunk(0, 5)], bucket)
    assert [c.num_new for c in padded] == [5, 15, 15, 15, 14]
    step = pad_step(build_step_inputs(padded, LAYOUT), bucket, spec.seqs_bound)
    assert step.comp[(1, 1, False)].vis_idx.shape == (64, 16)


def test_explicit_context_buckets():
    spec = BucketSpec(batch=(1, 2), contexts=(100, 300), prefill_tokens=16)
    assert spec.select([_chunk(99, 1)]).context == 100
    assert spec.select([_chunk(100, 1)]).context == 300
    assert spec.select([_chunk(300, 1)]) is None
    with pytest.raises(ValueError, match="largest bucket"):
        BucketSpec(batch=(1,), contexts=(128,), prefill_tokens=None, max_model_len=256)
    with pytest.raises(ValueError, match="PREFILL_BUCKET"):
        BucketSpec(batch=(1,), contexts=None, prefill_tokens=1)


def test_entry_cap_bounds_new_entries():
    # a step of n tokens per sequence closes at most n // m + 1 entries per sequence
    for m in (1, 2, 4, 16):
        for ctx in range(0, 20):
            for n in range(1, 20):
                closed = (ctx + n) // m - ctx // m
                assert closed <= entry_cap(n, m, 1)


LAYOUT = CacheLayout(window=4, num_slots=5, block_size=16, compressors=[(4, 8, True), (16, 16, False), (1, 1, False)])


def _padded(chunks, spec):
    bucket = spec.select(chunks)
    return spec.static_step(chunks, bucket, LAYOUT), bucket


def _shapes(step):
    out = {k: tuple(getattr(step, k).shape) for k in ("input_ids", "swa_idx", "swa_write_src", "swa_write_dst")}
    for key, m in step.comp.items():
        for f in ("src_idx", "src_valid", "entry_pos", "entry_dst", "state_src", "state_dst", "vis_idx", "vis_valid"):
            out[(key, f)] = tuple(getattr(m, f).shape)
    return out


def test_steps_in_one_bucket_have_identical_shapes():
    spec = BucketSpec(batch=(1, 2, 4), contexts=None, prefill_tokens=16)

    def seq(slot, ctx, new):
        return SeqChunk(slot, ctx, new, [slot * 3 + 1, slot * 3 + 2, slot * 3 + 3], list(range(ctx + new)))
    decode_a, ba = _padded([seq(1, 3, 1), seq(2, 15, 1), seq(3, 40, 1)], spec)   # entries close for some rows
    decode_b, bb = _padded([seq(1, 4, 1), seq(2, 2, 1), seq(3, 5, 1)], spec)      # and for none here
    assert ba == bb == Bucket(4, 4, 64)
    assert _shapes(decode_a) == _shapes(decode_b)
    pre_a, pa = _padded([seq(1, 0, 11)], spec)
    pre_b, pb = _padded([seq(1, 0, 3), seq(2, 20, 9), seq(3, 7, 1)], spec)
    assert pa.num_tokens == pb.num_tokens == 16 and pa.context == pb.context
    assert _shapes(pre_a) == _shapes(pre_b)
    m = decode_a.comp[(4, 8, True)]
    assert m.vis_idx.shape == (4, 64 // 4)
    # padding writes only go to scratch: slot 0 state rows / block 0 entry rows
    n_real_e = 2  # seq(1, 3, 1) and seq(2, 15, 1) close an entry of ratio 4
    assert (m.entry_dst[n_real_e:] == 0).all() and (m.entry_dst[:n_real_e] > 0).all()
    assert m.src_valid[n_real_e:].all()
    assert (decode_b.swa_write_dst[3:] < LAYOUT.window).all()  # placeholder row: slot 0 ring


def test_pad_step_rejects_what_does_not_fit():
    spec = BucketSpec(batch=(1,), contexts=(8,), prefill_tokens=None)
    step = build_step_inputs([SeqChunk(1, 30, 1, [1, 2], list(range(31)))], LAYOUT)
    with pytest.raises(ValueError, match="visible entries exceed the context bucket"):
        pad_step(step, Bucket(1, 1, 8), spec.seqs_bound)


def test_only_the_verify_rows_get_verification_buckets():
    """Default: the row buckets whose verification bucket is at most the largest row bucket's tokens
    (8 x 6 -> 64 at B = 5, the 64-row decode bucket's token count); a verification step with more rows
    runs in the prompt bucket, and the warm-up walks no bucket for the others."""
    from deepinfer.platforms.neuron.buckets import default_verify_rows
    assert default_verify_rows((8, 64), 6) == (8,)
    assert default_verify_rows((8, 64), 2) == (8,)        # 16 tokens; 64 rows x 2 = 128 > 64
    assert default_verify_rows((2,), 6) == (2,)           # the smallest row bucket always keeps one
    assert default_verify_rows((8, 64), 1) == (8, 64)     # no drafts: nothing to restrict
    spec = BucketSpec(batch=(8, 64), contexts=(256,), prefill_tokens=(512,), verify_tokens=6, pow2_tokens=True,
                      verify_rows=(8,))
    rows = [_chunk(10, 6, slot=i + 1) for i in range(8)]
    assert spec.select(rows).num_tokens == 64                         # 8 rows x 6 -> 64
    assert spec.select(rows + [_chunk(10, 6, slot=9)]).num_tokens == 512   # 9 rows: the prompt bucket
    assert {b.num_tokens for b in spec.all_buckets()} == {8, 64, 512}
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_VERIFY_ROWS"):
        BucketSpec(batch=(8, 64), contexts=(256,), prefill_tokens=None, verify_tokens=6, verify_rows=(16,))
    # Neuron rounds a verification bucket up to the decode bucket that holds it: its graphs are shared
    shared = BucketSpec(batch=(8, 64), contexts=(256,), prefill_tokens=(512,), verify_tokens=2, pow2_tokens=True,
                        verify_rows=(8,), verify_shares_decode=True)
    assert shared.verify_bucket_tokens(8) == 64 and {b.num_tokens for b in shared.all_buckets()} == {8, 64, 512}
    assert shared.select([_chunk(10, 2, slot=i + 1) for i in range(3)]).num_tokens == 64
