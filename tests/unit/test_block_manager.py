import pytest

from deepinfer.engine.block_manager import BlockManager
from deepinfer.sequence import Sequence


def _seq(seq_id=0, n=3):
    return Sequence(request_id=str(seq_id), seq_id=seq_id, prompt_token_ids=list(range(5, 5 + n)),
                    sampling_params=None, seed=0)


def test_reserved_scratch_block_and_slot_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4, num_state_slots=3)
    assert bm.num_free_blocks == 4 and bm.num_free_state_slots == 2
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 16)  # 4 blocks: the whole usable pool
    assert sorted(a.block_table) == [1, 2, 3, 4] and a.state_slot in (1, 2)
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 4
    assert not bm.can_allocate(b, 1)
    bm.free(a)
    bm.allocate(b, 1)
    assert 0 not in b.block_table and b.state_slot != 0
    bm.check_invariants()


def test_blocks_cover_ceil_positions_and_grow_incrementally():
    bm = BlockManager(num_blocks=10, block_size=4, num_state_slots=4)
    s = _seq()
    bm.allocate(s, 1)
    assert len(s.block_table) == 1
    bm.allocate(s, 4)
    assert len(s.block_table) == 1  # 4 positions still fit one block
    bm.allocate(s, 5)
    assert len(s.block_table) == 2
    slot = s.state_slot
    bm.allocate(s, 13)
    assert len(s.block_table) == 4 and s.state_slot == slot  # one slot per sequence
    assert bm.num_new_blocks(s, 20) == 1 and bm.num_new_blocks(s, 3) == 0
    assert bm.max_tokens_coverable(s) == (4 + 5) * 4
    assert len(set(s.block_table)) == 4
    bm.free(s)
    assert s.block_table == [] and s.state_slot is None
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 9 and bm.num_used_state_slots == 0
    bm.check_invariants()


def test_state_slots_limit_allocation():
    bm = BlockManager(num_blocks=10, block_size=4, num_state_slots=2)  # one usable slot
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 4)
    assert not bm.can_allocate(b, 1)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 1)
    assert bm.num_used_blocks == 1  # the failed allocation changed nothing
    bm.free(a)
    assert bm.can_allocate(b, 1)


def test_double_free_is_an_invariant_error():
    bm = BlockManager(num_blocks=4, block_size=2, num_state_slots=2)
    s = _seq()
    bm.allocate(s, 3)
    table, slot = list(s.block_table), s.state_slot
    bm.free(s)
    s.block_table, s.state_slot = table, slot  # a stale copy freed again
    with pytest.raises(AssertionError):
        bm.free(s)


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, 4)
    with pytest.raises(ValueError, match="num_state_slots"):
        BlockManager(4, 4, 1)
