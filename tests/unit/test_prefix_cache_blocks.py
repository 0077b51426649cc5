"""Block accounting of the prefix cache (engine/block_manager.py, engine/prefix_cache.py), no model:
reference counts, idle blocks counted free and reclaimed oldest first only when the free list is
empty, held blocks never reclaimed, hashes chained over the whole prefix and rooted at the group."""
import pytest

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.prefix_cache import block_hashes
from deepinfer.sequence import Sequence

BS = 4


def _seq(seq_id, tokens):
    return Sequence(request_id=str(seq_id), seq_id=seq_id, prompt_token_ids=list(tokens),
                    sampling_params=None, seed=0)


def _compute(bm, seq):
    """What the scheduler does for a sequence run to the end of its prompt in one step."""
    hit = bm.admit_cached(seq)
    bm.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register(seq)
    return hit


def test_hashes_chain_over_the_whole_prefix_and_the_group():
    a = block_hashes(list(range(12)), BS, 3)
    assert len(set(a)) == 3
    assert block_hashes(list(range(8)) + [99] * 4, BS, 3)[:2] == a[:2]
    assert block_hashes([99] + list(range(1, 12)), BS, 3)[1] != a[1]   # same block 1, other parent
    assert block_hashes(list(range(12)), BS, 3, group=1)[0] != a[0]
    assert block_hashes(list(range(12)), BS, 3, known=a[:1]) == a
    with pytest.raises(AssertionError):
        block_hashes(list(range(6)), BS, 2)


def test_shared_blocks_are_counted_and_freed_once_nobody_holds_them():
    bm = BlockManager(num_blocks=9, block_size=BS, num_state_slots=4, enable_prefix_caching=True)
    a = _seq(0, range(10))                 # 2 full blocks cached, a third partial
    assert _compute(bm, a) == 0
    b = _seq(1, list(range(8)) + [50, 51, 52])
    assert _compute(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and bm._refs[a.block_table[0]] == 2
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    bm.free(b)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8 and bm.prefix_cache.num_idle == 2
    # the last token is always computed: a prompt of exactly two blocks hits only the first
    c = _seq(2, range(8))
    assert bm.admit_cached(c) == 4
    bm.free(c)
    bm.check_invariants()


def test_idle_blocks_are_reclaimed_oldest_first_and_held_ones_never():
    bm = BlockManager(num_blocks=7, block_size=BS, num_state_slots=5, enable_prefix_caching=True)
    old, new = _seq(0, range(100, 109)), _seq(1, range(200, 209))
    _compute(bm, old)
    _compute(bm, new)
    bm.free(old)
    held = _seq(2, list(range(200, 208)) + [7])
    assert _compute(bm, held) == 8        # holds new's 2 cached blocks
    bm.free(new)
    bm.check_invariants()
    # 6 usable: held has 3, old's 2 are idle, 1 never-cached block is free
    assert bm.num_free_blocks == 3 and bm.prefix_cache.num_idle == 2
    big = _seq(3, range(300, 312))
    bm.allocate(big, 12)                  # the free block, then old's two (held's are not idle)
    assert bm.prefix_cache.num_evicted_blocks == 2
    assert not bm.prefix_cache.match(block_hashes(old.prompt_token_ids, BS, 2))
    assert len(bm.prefix_cache.match(block_hashes(held.prompt_token_ids, BS, 2))) == 2
    assert not bm.can_allocate(_seq(4, range(4)), 1)
    for s in (held, big):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == 6


def test_groups_do_not_share_blocks():
    bm = BlockManager(num_blocks=9, block_size=BS, num_state_slots=5, enable_prefix_caching=True,
                      num_groups=2)
    a = _seq(0, range(9))
    _compute(bm, a)                        # slot 1: group 1
    b = _seq(1, range(9))
    assert _compute(bm, b) == 0            # slot 2: group 0, computes its own
    c = _seq(2, range(9))
    assert _compute(bm, c) == 8 and c.state_slot % 2 == 1 and c.block_table[:2] == a.block_table[:2]
    for s in (a, b, c):
        bm.free(s)
    bm.check_invariants()


def test_caching_off_keeps_the_plain_pool():
    bm = BlockManager(num_blocks=5, block_size=BS, num_state_slots=3)
    a = _seq(0, range(9))
    assert _compute(bm, a) == 0
    assert bm.cacheable_len(a) == 0 and bm.prefix_cache is None
    bm.free(a)
    assert bm.num_free_blocks == 4
    bm.check_invariants()
