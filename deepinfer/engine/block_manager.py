"""KV block pool and per-sequence state slots.

Block 0 and state slot 0 are reserved scratch: padding rows of a batch point at them, so they are
never handed to a sequence. A block covers `block_size` consecutive token positions; a sequence
whose first L positions are computed or scheduled holds ceil(L / block_size) blocks.
"""

from __future__ import annotations

from collections import deque

from deepinfer.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_state_slots < 2:
            raise ValueError(
                f"num_state_slots must be >= 2 (slot 0 is reserved scratch), got {num_state_slots}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        # FIFO reuse keeps block ids spread out, which makes stale-data bugs show up in tests.
        self._free_blocks: deque[int] = deque(range(1, num_blocks))
        self._used_blocks: set[int] = set()
        self._free_slots: deque[int] = deque(range(1, num_state_slots))
        self._used_slots: set[int] = set()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_state_slots(self) -> int:
        return len(self._used_slots)

    def blocks_needed(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` covers its first `num_tokens` positions."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def max_tokens_coverable(self, seq: Sequence) -> int:
        """Largest position count `seq` could cover with its blocks plus every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.state_slot is None and not self._free_slots:
            return False
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    # ---- mutation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover `num_tokens` positions; give it a state slot if it has none."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(
                f"cannot allocate {num_tokens} positions for seq {seq.seq_id}: "
                f"{self.num_free_blocks} free blocks, {self.num_free_state_slots} free state slots")
        if seq.state_slot is None:
            slot = self._free_slots.popleft()
            assert slot not in self._used_slots, f"state slot {slot} handed out twice"
            self._used_slots.add(slot)
            seq.state_slot = slot
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            block = self._free_blocks.popleft()
            assert block not in self._used_blocks, f"block {block} handed out twice"
            self._used_blocks.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks and its state slot to the pool."""
        for block in seq.block_table:
            assert block in self._used_blocks, f"double free of block {block} (seq {seq.seq_id})"
            self._used_blocks.remove(block)
            self._free_blocks.append(block)
        seq.block_table = []
        if seq.state_slot is not None:
            slot = seq.state_slot
            assert slot in self._used_slots, f"double free of state slot {slot} (seq {seq.seq_id})"
            self._used_slots.remove(slot)
            self._free_slots.append(slot)
            seq.state_slot = None

    def check_invariants(self) -> None:
        """Every block/slot is either free or used, exactly once (leak and double-use check)."""
        assert len(self._free_blocks) + len(self._used_blocks) == self.num_blocks - 1, "block leak"
        assert self._used_blocks.isdisjoint(self._free_blocks), "block both free and used"
        assert 0 not in self._used_blocks and 0 not in self._free_blocks, "scratch block escaped"
        assert len(self._free_slots) + len(self._used_slots) == self.num_state_slots - 1, "slot leak"
        assert self._used_slots.isdisjoint(self._free_slots), "slot both free and used"
        assert 0 not in self._used_slots and 0 not in self._free_slots, "scratch slot escaped"
