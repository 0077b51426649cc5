"""KV block pool and per-sequence state slots.

Block 0 and state slot 0 are reserved scratch: padding rows of a batch point at them, so they are
never handed to a sequence. A block covers `block_size` consecutive token positions; a sequence
whose first L positions are computed or scheduled holds ceil(L / block_size) blocks.

With prefix caching (engine/prefix_cache.py) a block can be held by several sequences (a reference
count per used block); a cached block nobody holds is idle: counted free, reclaimed oldest first
only when the free list is empty.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.prefix_cache import PrefixCache, block_hashes
from deepinfer.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int,
                 enable_prefix_caching: bool = False, num_groups: int = 1):
        """num_groups: data-parallel groups whose ranks hold different sequences' KV (a cached block
        serves only sequences of the group that computed it)."""
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
        self._refs: dict[int, int] = {}  # used block -> sequences holding it
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.num_groups = max(1, int(num_groups))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: never used, or cached and held by nobody."""
        return len(self._free_blocks) + (self.prefix_cache.num_idle if self.prefix_cache else 0)

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
        self._take_slot(seq)
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            if self._free_blocks:
                block = self._free_blocks.popleft()
            else:
                block = self.prefix_cache.evict()
            assert block not in self._used_blocks, f"block {block} handed out twice"
            self._used_blocks.add(block)
            self._refs[block] = 1
            seq.block_table.append(block)

    def _take_slot(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            if not self._free_slots:
                raise RuntimeError(f"no free state slot for seq {seq.seq_id}")
            slot = self._free_slots.popleft()
            assert slot not in self._used_slots, f"state slot {slot} handed out twice"
            self._used_slots.add(slot)
            seq.state_slot = slot

    # ---- prefix caching ------------------------------------------------------------------
    def cacheable_len(self, seq: Sequence) -> int:
        """Positions of seq whose full blocks are cached once computed: its prompt's full blocks.
        Output tokens are not: their KV came from decode steps, and a draft's rows from a rejected
        verification never reach a block that is cached."""
        if self.prefix_cache is None:
            return 0
        return seq.prompt_len // self.block_size * self.block_size

    def _hashes(self, seq: Sequence) -> list[bytes]:
        n = self.cacheable_len(seq) // self.block_size
        if len(seq.prefix_hashes) < n:
            seq.prefix_hashes = block_hashes(seq.prompt_token_ids, self.block_size, n,
                                             seq.state_slot % self.num_groups, seq.prefix_hashes)
        return seq.prefix_hashes

    def admit_cached(self, seq: Sequence) -> int:
        """Give a sequence that holds nothing its state slot and the cached blocks of its longest cached
        prompt prefix, its last token excluded (its logits are needed); returns the positions covered
        (now computed)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        self._take_slot(seq)
        if self.prefix_cache is None:
            return 0
        # a prompt still to be scored needs every position's logits
        limit = (len(seq) - 1) // self.block_size if seq.prompt_logprobs_done else 0
        blocks = self.prefix_cache.match(self._hashes(seq)[:limit])
        for block in blocks:
            if block in self._refs:
                self._refs[block] += 1
            else:
                self.prefix_cache.unpark(block)
                self._used_blocks.add(block)
                self._refs[block] = 1
            seq.block_table.append(block)
        seq.num_registered_blocks = len(blocks)
        hit = len(blocks) * self.block_size
        seq.num_computed_tokens = hit
        return hit

    def register(self, seq: Sequence) -> None:
        """Name seq's newly computed full prompt blocks in the cache (after the step that computed them)."""
        if self.prefix_cache is None or seq.state_slot is None:
            return
        n = min(seq.num_computed_tokens, self.cacheable_len(seq), len(seq.block_table) * self.block_size)
        n //= self.block_size
        if n <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq)
        for j in range(seq.num_registered_blocks, n):
            self.prefix_cache.insert(hashes[j], seq.block_table[j])
        seq.num_registered_blocks = n

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks (a cached one stays cached, idle) and its state slot."""
        cached = []
        for block in seq.block_table:
            assert block in self._used_blocks, f"double free of block {block} (seq {seq.seq_id})"
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            self._used_blocks.remove(block)
            if self.prefix_cache is not None and block in self.prefix_cache:
                cached.append(block)
            else:
                self._free_blocks.append(block)
        # a prefix's later blocks are released first, so they are reclaimed before its earlier ones
        for block in reversed(cached):
            self.prefix_cache.park(block)
        seq.block_table = []
        seq.num_registered_blocks = 0
        if self.num_groups > 1:
            seq.prefix_hashes = []   # hashed for this slot's group; the next slot may be another's
        if seq.state_slot is not None:
            slot = seq.state_slot
            assert slot in self._used_slots, f"double free of state slot {slot} (seq {seq.seq_id})"
            self._used_slots.remove(slot)
            self._free_slots.append(slot)
            seq.state_slot = None

    def check_invariants(self) -> None:
        """Every block/slot is either free or used, exactly once (leak and double-use check)."""
        idle = set(self.prefix_cache.idle) if self.prefix_cache is not None else set()
        assert len(self._free_blocks) + len(self._used_blocks) + len(idle) == self.num_blocks - 1, "block leak"
        assert self._used_blocks.isdisjoint(self._free_blocks), "block both free and used"
        assert idle.isdisjoint(self._used_blocks) and idle.isdisjoint(self._free_blocks), "idle block in use"
        assert set(self._refs) == self._used_blocks and all(r > 0 for r in self._refs.values()), "bad refs"
        if self.prefix_cache is not None:
            assert idle <= set(self.prefix_cache.hash_of), "idle block not cached"
            assert set(self.prefix_cache.hash_of).isdisjoint(self._free_blocks), "free block still cached"
        assert 0 not in self._used_blocks and 0 not in self._free_blocks, "scratch block escaped"
        assert len(self._free_slots) + len(self._used_slots) == self.num_state_slots - 1, "slot leak"
        assert self._used_slots.isdisjoint(self._free_slots), "slot both free and used"
        assert 0 not in self._used_slots and 0 not in self._free_slots, "scratch slot escaped"
